"""The Session's processors: what each turn event (:class:`~agentkv._session.pipeline.TurnEvent`) does, one concern
each, registered where it applies (:func:`registered`):

- :func:`counted`: the Session's stats (``stats()``);
- :func:`logged`: the structlog event;
- :func:`traced`: the turn's OpenTelemetry span events and metrics;
- :func:`learned`: what an answer teaches (the estimate bound, a silent server clamp, the cache's moves, the
  ledger's prediction) and the cost gate's tally of a warm's outcome;
- :func:`priced`: a managed API's cache tokens and dollars, registered only when a backend of the Session is one.

Adding one is a function here and a line in :func:`registered`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from agentkv._session import hosted
from agentkv._session.pipeline import Processor, TurnEvent
from agentkv.backends import Backend
from agentkv.events import emit, enabled, prompt_fields
from agentkv.fleet import affinity_missed
from agentkv.providers import account, strategy_for
from agentkv.retry import outage_cause
from agentkv.telemetry import turns
from agentkv.warm.sender import COUNTED_SKIPS
from agentkv.wire.usage import server_clamped

if TYPE_CHECKING:
    from agentkv._session.attempts import Attempt
    from agentkv._session.parts import SessionParts

__all__ = ["counted", "learned", "logged", "priced", "registered", "traced"]

# What each kind of event counts in the Session's stats (a count of one each; a handoff's figures come from its data).
_COUNTERS: dict[str, tuple[str, ...]] = {
    "overflowed": ("overflow_errors",), "recovered": ("reactive_fallbacks",), "failed_over": ("failovers",),
    "replica_failed_over": ("replica_failovers",),
}


def counted(s: "SessionParts", event: TurnEvent) -> None:
    """The Session's stats: a count per kind, a handoff's mapped tokens and fallbacks, an affinity miss."""
    for name in _COUNTERS.get(event.kind, ()):
        s.session_stats.add(name)
    if event.kind == "routed" and event.data["opening"] and event.attempt.decision.note:
        s.session_stats.add("catalog_refusals")
    if event.kind == "warmed":
        outcome = event.data["outcome"]
        if outcome in COUNTED_SKIPS:
            s.session_stats.add(f"warm_skipped_{outcome}")
        elif outcome == "fire" and not event.data["check"]:  # a check is counted once its job knows what slow holds
            s.session_stats.add("warm_fired")
    if event.kind == "handed_off":
        s.session_stats.add("mapped_tokens", event.data["mapped_tokens"])
        s.session_stats.add("handoff_fallbacks", int(event.data["fallback"]))
    if event.kind == "answered" and _affinity_missed(event):
        s.session_stats.add("affinity_misses")


def logged(s: "SessionParts", event: TurnEvent) -> None:
    """The structlog event of each kind that has one (sizes, names and error types)."""
    attempt, data = event.attempt, event.data
    if event.kind == "routed":
        _route_logged(s, attempt)
    elif event.kind == "warmed" and data["outcome"] == "fire" and not data["check"]:
        emit("warm_fired", estimate=attempt.count.total, session=s.session_id, tenant=s.tenant)
    elif event.kind == "overflowed":
        emit("overflow", level="warning", variant=data["variant"], action=data["action"], why=data["why"],
             backend=attempt.backend.label, server_window=data["server_window"], prompt=data["prompt"])
    elif event.kind in ("failed_over", "replica_failed_over"):
        error = data["error"]
        if event.kind == "failed_over":
            emit("failover", level="warning", error=type(error).__name__, cause=outage_cause(error),
                 status_code=getattr(error, "status_code", None), failed=attempt.backend.label, to=data["to"],
                 session=s.session_id, tenant=s.tenant)
        else:
            emit("replica_failover", level="warning", error=type(error).__name__, cause=outage_cause(error),
                 backend=attempt.backend.label, failed=data["failed"], to=data["to_url"], session=s.session_id,
                 tenant=s.tenant)
    elif event.kind == "answered" and _affinity_missed(event):
        usage = data["usage"]
        emit("affinity_miss", level="warning", backend=attempt.backend.label, expected=data["expected"],
             cached=usage.cached_tokens, session=s.session_id, tenant=s.tenant)


def _route_logged(s: "SessionParts", attempt: "Attempt") -> None:
    """The ``route`` event: the decision, the count it was made on, and (at ``info``) the prompt's fields."""
    decision, counted = attempt.decision, attempt.count
    emit(
        "route", reason=decision.reason, target=decision.backend, role=decision.role,
        estimate=decision.estimated_input_tokens, floor=s.routing.output_floor, window=decision.window,
        max_tokens=decision.max_tokens, count_source=counted.source, exact=counted.exact,
        tool_tokens=counted.tools, session=s.session_id, tenant=s.tenant, note=decision.note or None,
        **(prompt_fields(s.history[-1] if s.history else None) if enabled("info") else {}),
    )


def traced(s: "SessionParts", event: TurnEvent) -> None:
    """The turn's span: started when routed, the warm's outcome, an overflow recovered, a failover, the handoff's
    span ended, the answer."""
    attempt, data = event.attempt, event.data
    if event.kind == "routed" and data["opening"]:
        turns.planned(attempt, tenant=s.tenant_digest, conversation=s.routing_key, warm_span=s.warm.span,
                      escalation=data["escalation"])
    elif event.kind == "warmed":
        turns.warmed(attempt)
    elif event.kind == "failed":
        turns.failed(attempt, data["error"])
    elif event.kind == "recovered":
        turns.recovered(attempt, action=data["action"], variant=data["variant"])
    elif event.kind in ("failed_over", "replica_failed_over"):
        turns.failed_over(attempt, error=data["error"], to=data["to"], replica=event.kind == "replica_failed_over")
    elif event.kind == "handed_off":
        turns.ended_handoff(data["span"], mapped_tokens=data["mapped_tokens"], fallback=data["fallback"])
    elif event.kind == "answered":
        turns.answered(attempt, data["usage"], escalation=data["escalation"],
                       warm_tokens=data["warm_tokens"] if data["warmed"] else None)


def learned(s: "SessionParts", event: TurnEvent) -> None:
    """What an answer's usage teaches: the ledger's prediction its outcome, the backend's estimate bound a claim (no
    single answer widens it), a silent server clamp (vLLM 0.32: 200, ``finish_reason`` "length", fewer tokens than
    sent) a rediscovery of the real window, and a slow answer where its conversation's cache now ends."""
    if event.kind == "warmed" and s.slow is not None:  # the cost gate's tally: a conversation crossed the threshold
        hosted.tally(s, s.backend("slow"), event.data["outcome"], escalated=False)
    if event.kind != "answered":
        return
    attempt, usage, prediction = event.attempt, event.data["usage"], event.data["prediction"]
    if prediction is not None:
        prediction.reported(usage.cached_tokens)
    if attempt.decision.role == "slow":
        s.slow_prompt_tokens = usage.prompt_tokens
        if attempt.payload.messages is not None and strategy_for(attempt.backend).cache_moves(attempt.backend, usage):
            s.cache_end = len(attempt.payload.messages)  # this turn's marks wrote (or the next one's write) up to here
    if usage.prompt_tokens is not None:
        s.counter(attempt.backend).learn(attempt.payload, usage.prompt_tokens, origin="usage", session=s.session_id)
    if server_clamped(usage, attempt.decision.max_tokens):
        s.recorder.server_clamp(attempt, usage, session=s.session_id, tenant=s.tenant)
        s.discovery.rediscover(attempt.backend)


def priced(s: "SessionParts", event: TurnEvent) -> None:
    """A managed API's answer: its cache tokens and dollars, an escalation's read saving apart."""
    if event.kind == "answered":
        data = event.data
        account(s.session_stats, event.attempt.backend, data["usage"], escalation=data["escalation"] and data["warmed"],
                session=s.session_id)


def _affinity_missed(event: TurnEvent) -> bool:
    """A slow answer that found far less cached than it should have."""
    return event.attempt.decision.role == "slow" and affinity_missed(event.data["expected"],
                                                                     event.data["usage"].cached_tokens)


def registered(backends: Sequence[Backend]) -> tuple[Processor, ...]:
    """The processors of a Session whose backends are ``backends``, each where it applies (:func:`priced` only
    beside a managed API)."""
    found: list[Processor] = [counted, logged, traced, learned]
    if any(not b.self_hosted for b in backends):
        found.append(priced)
    return tuple(found)
