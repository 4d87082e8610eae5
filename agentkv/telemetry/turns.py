"""A turn's spans and metrics, from the data a Session already has: its attempt (route, backend, count), the answer's
usage, the error that ended it. The Session calls these at fixed points (planned, each try, warm outcome, recovery,
failover, answered, failed); each is a no-op unless an OpenTelemetry SDK is configured (:mod:`agentkv.telemetry.otel`).

Span attributes, beyond the GenAI conventions' own: ``agentkv.route.role``/``.reason``/``.backend``,
``agentkv.tokens.estimated``/``.exact``/``.count_source``/``.tools``, ``agentkv.window``, ``agentkv.warm.outcome``,
``agentkv.tenant`` (a digest, keyed by the cache-salt secret when one is set), ``agentkv.replica`` (a pool's replica,
without credentials, query string or fragment).

Each entry point is guarded (:func:`agentkv.telemetry.otel.guarded`), and so is each span update and metric point
within it: an SDK that raises loses that span or point, never the turn.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from agentkv.http.transport import redact_url
from agentkv.telemetry.otel import (added, annotated, ended, event, guarded, instruments, link_to, messages_attribute,
                                    now, provider_attributes, recorded, span_in, tracer)

__all__ = ["answered", "failed", "failed_over", "handoff_span", "planned", "recovered", "try_span", "warm_attributes",
           "warmed"]


def _operation(attempt: Any) -> str:
    return "text_completion" if attempt.text else "chat"


def _server(backend: Any) -> dict[str, Any]:
    if not backend.api_base:
        return {}
    parts = urlsplit(backend.api_base)
    try:
        port = parts.port
    except ValueError:  # a port that is no number: the address alone (building attributes never raises)
        port = None
    return {"server.address": parts.hostname, "server.port": port or (443 if parts.scheme == "https" else 80)}


def _model(backend: Any) -> dict[str, Any]:
    return {"gen_ai.request.model": backend.served_model, **provider_attributes(backend.model), **_server(backend)}


@guarded(None)
def planned(attempt: Any, *, tenant: str | None, conversation: str | None, warm_span: Any = None,
            escalation: bool = False) -> None:
    """The turn's span starts (on ``attempt.span``): its route and count; an escalation links to ``warm_span``.
    ``tenant``: the tenant's digest (:func:`agentkv.telemetry.tenant_digest`, keyed by the Session's secret)."""
    found = instruments()
    decision, count = attempt.decision, attempt.count
    if found is not None:
        added(found.routes, 1, {"agentkv.route.role": decision.role, "agentkv.route.reason": decision.reason})
    if tracer() is None:
        return
    operation = _operation(attempt)
    attributes = {
        "gen_ai.operation.name": operation, **_model(attempt.backend),
        "gen_ai.request.max_tokens": decision.max_tokens, "gen_ai.conversation.id": conversation,
        "agentkv.route.role": decision.role, "agentkv.route.reason": decision.reason,
        "agentkv.route.backend": decision.backend, "agentkv.route.escalation": escalation,
        "agentkv.tokens.estimated": count.total, "agentkv.tokens.exact": count.exact,
        "agentkv.tokens.count_source": count.source, "agentkv.tokens.tools": count.tools,
        "agentkv.window": decision.window, "agentkv.tenant": tenant,
        **_replica(attempt.backend), **messages_attribute(attempt.payload.messages),
    }
    attempt.span = span_in(None, f"{operation} {attempt.backend.served_model}", attributes, kind="CLIENT",
                           links=link_to(warm_span) if escalation else ())
    attempt.span_started = now()


def _replica(backend: Any) -> dict[str, Any]:
    return {"agentkv.replica": redact_url(backend.api_base)} if getattr(backend, "member_of", None) else {}


@guarded(None)
def warmed(attempt: Any) -> None:
    """The warm-ahead decision for this turn (``attempt.warm``): on its span, and counted by outcome."""
    found = instruments()
    if found is not None and attempt.warm:
        added(found.warms, 1, {"agentkv.warm.outcome": attempt.warm})
    if attempt.warm:
        annotated(attempt.span, {"agentkv.warm.outcome": attempt.warm})


def warm_attributes(slow: Any, tokens: int | None) -> dict[str, Any]:
    """A warm span's attributes: the slow model it warms and the prompt's estimated size."""
    return {"gen_ai.operation.name": "chat", **_model(slow), "gen_ai.request.max_tokens": 1,
            "agentkv.warm.tokens": tokens, **_replica(slow)}


@guarded(None)
def try_span(attempt: Any) -> Any:
    """A try's span (a child of the turn's), or None."""
    if attempt.span is None:
        return None
    operation = _operation(attempt)
    return span_in(attempt.span, f"{operation} {attempt.backend.served_model}",
                   {"gen_ai.operation.name": operation, **_model(attempt.backend),
                    "agentkv.route.role": attempt.decision.role, "gen_ai.request.max_tokens": attempt.decision.max_tokens,
                    **_replica(attempt.backend)}, kind="CLIENT")


@guarded(None)
def recovered(attempt: Any, *, action: str, variant: str) -> None:
    """An overflow recovered (clamped or escalated): an event on the turn's span, and counted."""
    found = instruments()
    if found is not None:
        added(found.overflows, 1, {"agentkv.overflow.action": action})
    event(attempt.span, "agentkv.overflow", {"agentkv.overflow.action": action, "agentkv.overflow.variant": variant})


@guarded(None)
def failed_over(attempt: Any, *, error: BaseException, to: str, replica: bool) -> None:
    """The turn moved off a backend (or a pool's replica) found down: an event on its span, and counted."""
    found = instruments()
    kind = "replica" if replica else "backend"
    if found is not None:
        added(found.failovers, 1, {"agentkv.failover.kind": kind})
    event(attempt.span, "agentkv.failover", {"agentkv.failover.kind": kind, "error.type": type(error).__name__,
                                             "agentkv.failover.to": to})


@guarded(None)
def handoff_span(attempt: Any) -> Any:
    """The KV handoff's span (a child of the turn's), or None."""
    return span_in(attempt.span, "agentkv.handoff", {"agentkv.handoff.target": attempt.backend.label})


@guarded(None)
def ended_handoff(span: Any, *, mapped_tokens: int, fallback: bool) -> None:
    """The KV handoff's span ends with what it mapped."""
    ended(span, attributes={"agentkv.handoff.mapped_tokens": mapped_tokens, "agentkv.handoff.fallback": fallback})


@guarded(None)
def answered(attempt: Any, usage: Any, *, escalation: bool, warm_tokens: int | None) -> None:
    """The turn's answer: usage on its span (which ends), the token and duration histograms, an escalation counted by
    whether it found the warm cached."""
    attributes = {"gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens,
                  "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
                  "gen_ai.usage.cache_creation.input_tokens": getattr(usage, "cache_write_tokens", None),
                  "gen_ai.response.model": attempt.backend.served_model,
                  "gen_ai.response.finish_reasons": [usage.finish_reason] if usage.finish_reason else None,
                  "agentkv.warm.outcome": attempt.warm or None}
    span, attempt.span = attempt.span, None
    ended(span, attributes=attributes)
    _measured(attempt, usage, escalation, warm_tokens)


@guarded(None)
def _measured(attempt: Any, usage: Any, escalation: bool, warm_tokens: int | None) -> None:
    found = instruments()
    if found is None:
        return
    common = {"gen_ai.operation.name": _operation(attempt), "gen_ai.request.model": attempt.backend.served_model,
              **provider_attributes(attempt.backend.model)}
    for kind, tokens in (("input", usage.prompt_tokens), ("output", usage.completion_tokens)):
        if tokens is not None:
            recorded(found.token_usage, tokens, {**common, "gen_ai.token.type": kind})
    started = getattr(attempt, "span_started", None)
    if started is not None:
        recorded(found.duration, now() - started, common)
    if escalation:
        warm = bool(warm_tokens and usage.cached_tokens and usage.cached_tokens >= 0.5 * warm_tokens)
        added(found.escalations, 1, {"agentkv.escalation.found_warm": warm})


@guarded(None)
def failed(attempt: Any, error: BaseException) -> None:
    """The turn ended in ``error``: its span ends with the error's type (never its text)."""
    span, attempt.span = attempt.span, None
    ended(span, error=error)
    found = instruments()
    started = getattr(attempt, "span_started", None)
    if found is not None and started is not None:
        recorded(found.duration, now() - started, {"gen_ai.operation.name": _operation(attempt),
                                                "gen_ai.request.model": attempt.backend.served_model,
                                                "error.type": type(error).__name__})

