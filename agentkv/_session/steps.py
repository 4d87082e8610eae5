"""What one request goes through, as functions over a :class:`~agentkv._session.state.SessionState`: gathering its
inputs (the only I/O: window facts and counts), opening and planning it (the pure core decides), warm-ahead, the
handoff at the escalation, and what happens at its answer. The drivers (:mod:`agentkv._session.driver`,
:mod:`agentkv._session.drive`) call these in order; none of them loops or retries.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import agentkv._env as _env
from agentkv._session.attempts import Attempt, raw_warm_target, warm_body, warm_kwargs
from agentkv._session.decide import Action, Outcome, next_action
from agentkv._session.inputs import Facts, max_tokens_of, request_payload, to_facts
from agentkv._session.prediction import Prediction, schedule_prediction
from agentkv._session.state import SessionState
from agentkv._session.warm_prefix import schedule_warm_prefix_check
from agentkv.errors import ContextOverflowError
from agentkv.events import emit, enabled, prompt_fields
from agentkv.routing import RouteDecision, decide_route, interval_decides, is_escalation
from agentkv.tenancy import screen_caller_salts
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.payload import detached
from agentkv.wire.usage import Usage, server_clamped

__all__ = ["acount", "afacts", "amaybe_warm", "arecount", "count", "decide", "decides", "facts", "finish", "hand_off",
           "log_route", "maybe_warm", "next_step", "open_request", "plan", "recount"]


# ----------------------------------------------------------------- gathering inputs (the only I/O)

def facts(s: SessionState) -> Facts:
    """The backends' windows and served models, as discovered now (cached, single flight)."""
    fast = s.discovery.window(s.fast, model_known=False)
    slow = s.discovery.window(s.slow) if s.slow is not None else None
    return to_facts(s.fast, s.slow, fast, slow)


async def afacts(s: SessionState) -> Facts:
    fast = await s.discovery.awindow(s.fast, model_known=False)
    slow = await s.discovery.awindow(s.slow) if s.slow is not None else None
    return to_facts(s.fast, s.slow, fast, slow)


def count(s: SessionState, kwargs: Mapping[str, Any], payload: Payload, known: Facts) -> TokenCount:
    """Fast's count: the local estimate, or the exact one where a decision depends on it."""
    return s._counter(s.fast).count_for(payload, decides(s, kwargs, known))


async def acount(s: SessionState, kwargs: Mapping[str, Any], payload: Payload, known: Facts) -> TokenCount:
    return await s._counter(s.fast).acount_for(payload, decides(s, kwargs, known))


def decides(s: SessionState, kwargs: Mapping[str, Any], known: Facts) -> Callable[[int, int], bool]:
    """Whether a count interval is enough for every decision this request meets (else it is counted exactly)."""
    warm = s.warm_ahead.threshold if s.slow is not None else None
    return functools.partial(interval_decides, max_tokens=max_tokens_of(kwargs), fast=known.fast, slow=known.slow,
                             policy=s.routing, warm_threshold=warm)


def recount(s: SessionState, attempt: Attempt) -> TokenCount:
    """The failed backend's count of the request: fast's exact count is reused, others are asked (and an
    exact answer teaches that backend's estimate bound)."""
    if attempt.count.exact and attempt.backend is s.fast:
        return attempt.count
    return _learned(s, attempt, s._counter(attempt.backend).count(attempt.payload))


async def arecount(s: SessionState, attempt: Attempt) -> TokenCount:
    if attempt.count.exact and attempt.backend is s.fast:
        return attempt.count
    return _learned(s, attempt, await s._counter(attempt.backend).acount(attempt.payload))


def _learned(s: SessionState, attempt: Attempt, counted: TokenCount) -> TokenCount:
    if counted.exact:
        s._counter(attempt.backend).learn(attempt.payload, counted.total, origin="recovery")
    return counted


# ----------------------------------------------------------------- opening and planning (no I/O below here)

def open_request(s: SessionState, kwargs: dict[str, Any], *, text: bool = False) -> Payload:
    """The request's payload, checked; ``text``: a prompt-only body (a text completion) is accepted too."""
    if s.closed:
        raise RuntimeError(f"Session {s.session_id!r} is closed")
    max_tokens_of(kwargs)  # a bad budget is refused before any count or network call
    screen_caller_salts(kwargs, s.cache_salt, keep=s._keeps_caller_salt, session=s.session_id,
                        tenant=s.tenant)  # so is a bad salt of the caller's own; another is replaced
    payload = request_payload(kwargs, s._backends(), s.counters.values())
    if payload.messages is None and not text:
        raise ValueError("Session.completion needs 'messages'; 'prompt' alone is a text completion")
    s._history = [*s._history[-1:], detached(payload)]  # as sent, whatever the caller edits later
    return payload


def decide(s: SessionState, kwargs: Mapping[str, Any], counted: TokenCount, known: Facts) -> RouteDecision:
    return decide_route(route_tokens=counted.total, safe_tokens=counted.safe, max_tokens=max_tokens_of(kwargs),
                        fast=known.fast, slow=known.slow, policy=s.routing, count_source=counted.source)


def plan(s: SessionState, kwargs: dict[str, Any], payload: Payload, counted: TokenCount, known: Facts) -> Attempt:
    """The turn's first attempt: routed, clamped, logged."""
    try:
        decision = decide(s, kwargs, counted, known)
    except ContextOverflowError:
        s._stats.add("slow_overflow_refusals")
        raise
    if decision.note:
        s._stats.add("catalog_refusals")
    log_route(s, decision, counted)
    return Attempt(decision, s._backend(decision.role), kwargs, payload, counted, s.cache_salt,
                   timeout_s=s.request_timeout_s, sent_at=s._stamp(), keeps_caller_salt=s._keeps_caller_salt)


def log_route(s: SessionState, decision: RouteDecision, counted: TokenCount) -> None:
    s.last_route = decision
    emit(
        "route", reason=decision.reason, target=decision.backend, role=decision.role,
        estimate=decision.estimated_input_tokens, floor=s.routing.output_floor, window=decision.window,
        max_tokens=decision.max_tokens, count_source=counted.source, exact=counted.exact,
        tool_tokens=counted.tools, session=s.session_id, tenant=s.tenant, note=decision.note or None,
        **(prompt_fields(s._history[-1] if s._history else None) if enabled("info") else {}),
    )


def next_step(s: SessionState, attempt: Attempt, outcome: Outcome | None) -> Action:
    """What ``attempt``'s turn does next (:func:`~agentkv._session.decide.next_action` over this Session's state)."""
    return next_action(attempt.decision, outcome, handed_off=attempt.handed_off, handoff_active=s.handoff.active,
                       previous_role=s._record.previous_role, has_slow=s.slow is not None, retry=s.retry,
                       streamed=attempt.turn.streamed)


# ----------------------------------------------------------------- the handoff, at the answer

def hand_off(s: SessionState, attempt: Attempt) -> None:
    """The KV handoff before the escalated try (torch work or an export: the async loop runs it on a thread)."""
    if s.slow is None:
        return
    attempt.handed_off = True
    previous = s._history[-2] if len(s._history) > 1 else None  # what fast last served: cheap to export
    outcome = s.handoff.at_escalation(s.fast, s.slow, attempt.payload, s.cache_salt, attempt=attempt,
                                      previous=previous, warm=s._warm, http=s.http)
    s._stats.add("mapped_tokens", outcome.mapped_tokens)
    s._stats.add("handoff_fallbacks", int(outcome.fallback))


def finish(s: SessionState, attempt: Attempt, response: Any, *, asynchronous: bool) -> Any:
    """Record the answered ``attempt``: stats, the ledger row, the escalation, its import, its cached tokens."""
    s.handoff.answered(attempt.handoff_export, response, s._stats)  # what slow loaded for the import named
    escalation = is_escalation(s._record.previous_role, attempt.decision)
    warmed = s._warm.warmed
    prediction = _predict(s, attempt, asynchronous)

    def on_usage(usage: Usage) -> None:
        if prediction is not None:
            prediction.reported(usage.cached_tokens)
        _answered_usage(s, attempt, usage)

    result = s._record.finish(attempt, response, escalation=escalation, after_warm=warmed is not None,
                              on_usage=on_usage)
    if escalation and warmed is not None:  # the broken-warm diagnostic, off the request path
        schedule_warm_prefix_check(s._jobs, s._counter(attempt.backend), warmed, attempt.payload, s._stats,
                                   s.session_id, asynchronous=asynchronous)
    return result


def _answered_usage(s: SessionState, attempt: Attempt, usage: Usage) -> None:
    """What an answer's usage teaches: the server's exact prompt count trains the backend's estimate bound,
    and a silent server clamp (vLLM 0.32: 200, ``finish_reason`` "length", fewer tokens than sent) is
    recorded and sends discovery back to the server for the real window."""
    if usage.prompt_tokens is not None:
        s._counter(attempt.backend).learn(attempt.payload, usage.prompt_tokens, origin="usage")
    if server_clamped(usage, attempt.decision.max_tokens):
        s._record.server_clamp(attempt, usage, session=s.session_id, tenant=s.tenant)
        s.discovery.rediscover(attempt.backend)


def _predict(s: SessionState, attempt: Attempt, asynchronous: bool) -> Prediction | None:
    """Start the ledger's prediction for a request to a backend it follows (worked out in the background)."""
    ledger, sent_at = s.cache_ledger, attempt.sent_at
    if ledger is None or sent_at is None or not ledger.follows(attempt.backend):
        return None
    prediction = Prediction(ledger, attempt.backend, s._stats)
    schedule_prediction(s._jobs, prediction, s._counter(attempt.backend), attempt.payload, attempt.cache_salt,
                        sent_at, asynchronous=asynchronous)
    return prediction


# ----------------------------------------------------------------- warm-ahead

def maybe_warm(s: SessionState, attempt: Attempt, known: Facts) -> None:
    """Consider warm-ahead for ``attempt`` and fire it on a pool thread when due."""
    if s.slow is not None:
        attempt.warm = s._warm.consider(attempt.payload, **_warm_inputs(s, attempt, known))
        _send_warm(s, attempt, asynchronous=False)


async def amaybe_warm(s: SessionState, attempt: Attempt, known: Facts) -> None:
    """The async twin of :func:`maybe_warm`: the shared store's claim is awaited, the warm runs as a task."""
    if s.slow is not None:
        attempt.warm = await s._warm.aconsider(attempt.payload, **_warm_inputs(s, attempt, known))
        _send_warm(s, attempt, asynchronous=True)


def _warm_inputs(s: SessionState, attempt: Attempt, known: Facts) -> dict[str, Any]:
    boundary = None if known.fast.window is None else known.fast.window - s.routing.output_floor
    return dict(estimated_tokens=attempt.count.total, fast_window=known.fast.window,
                routed_role=attempt.decision.role, model_known=known.slow_model_known,
                enabled=_env.warm_ahead_enabled(), boundary_tokens=boundary)


def _send_warm(s: SessionState, attempt: Attempt, asynchronous: bool) -> None:
    if not s._warm.wants_send(attempt.warm) or s.slow is None:
        return
    text = attempt.text  # a text completion warms ``/completions`` with its prompt
    url = raw_warm_target(s.slow, text=text)
    try:
        if url is None and text:
            raise ValueError("a text completion is warmed only by a raw POST to a self-hosted slow backend")
        if url is not None:  # a raw POST: the same bytes as the request, no litellm import on the way
            body = warm_body(s.slow, attempt.kwargs, s.cache_salt, raw=attempt.raw,
                             keep_caller_salt=attempt.keeps_caller_salt)
            (s._warm.apost if asynchronous else s._warm.post)(url, body, s.http)
            return
        call = warm_kwargs(s.slow, attempt.kwargs, s.cache_salt, s.warm_ahead.timeout_s,
                           keep_caller_salt=attempt.keeps_caller_salt)
    except Exception as exc:  # building a warm never raises into the caller
        s._warm.abandon(exc)
        return
    (s._warm.asend if asynchronous else s._warm.send)(call, s.client)
