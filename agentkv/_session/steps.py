"""What one request goes through between its inputs and its answer, as steps over a
:class:`~agentkv._session.parts.SessionParts`: opening and planning it (the pure core decides), the next step of its
turn, the handoff at the escalation, and what happens at its answer. Inputs are gathered by
:mod:`agentkv._session.gather`, warm-ahead is :mod:`agentkv._session.warming`, and :mod:`agentkv._session.turn` runs
them in order.
"""

from __future__ import annotations

from typing import Any, Mapping

from agentkv._session import hosted
from agentkv._session.attempts import Attempt
from agentkv._session.decide import Action, Outcome, next_action
from agentkv._session.inputs import Facts, max_tokens_of, request_payload
from agentkv._session.parts import SessionParts
from agentkv._session.pipeline import TurnEvent
from agentkv._session.prediction import Prediction, predicting
from agentkv._session.warm_prefix import checking_warm_prefix
from agentkv._support.effects import Machine
from agentkv.errors import ContextOverflowError
from agentkv.fleet import routing_headers
from agentkv.routing import RouteDecision, decide_route, is_escalation
from agentkv.telemetry import turns
from agentkv.tenancy import screen_caller_salts
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.payload import detached

__all__ = ["decide", "finish", "hand_off", "routed", "next_step", "open_request", "plan"]


def open_request(s: SessionParts, kwargs: dict[str, Any], *, text: bool = False) -> Payload:
    """The request's payload, checked; ``text``: a prompt-only body (a text completion) is accepted too."""
    if s.closed:
        raise RuntimeError(f"Session {s.session_id!r} is closed")
    max_tokens_of(kwargs)  # a bad budget is refused before any count or network call
    screen_caller_salts(kwargs, s.cache_salt, keep=s.keeps_caller_salt, session=s.session_id,
                        tenant=s.tenant)  # so is a bad salt of the caller's own; another is replaced
    payload = request_payload(kwargs, s.backends(), s.counters.values())
    if payload.messages is None and not text:
        raise ValueError("Session.completion needs 'messages'; 'prompt' alone is a text completion")
    s.history = [*s.history[-1:], detached(payload)]  # as sent, whatever the caller edits later
    return payload


def decide(s: SessionParts, kwargs: Mapping[str, Any], counted: TokenCount, known: Facts) -> RouteDecision:
    return decide_route(route_tokens=counted.total, safe_tokens=counted.safe, max_tokens=max_tokens_of(kwargs),
                        fast=known.fast, slow=known.slow, policy=s.routing, count_source=counted.source)


def plan(s: SessionParts, kwargs: dict[str, Any], payload: Payload, counted: TokenCount, known: Facts, *,
         headers: Mapping[str, str] | None = None) -> Attempt:
    """The turn's first attempt: routed, clamped, addressed (a pool's replica for this conversation), logged.
    ``headers``: a raw request's own (the routing ones among them ride on its warm)."""
    try:
        decision = decide(s, kwargs, counted, known)
    except ContextOverflowError:
        s.session_stats.add("slow_overflow_refusals")
        raise
    if payload.messages is not None and s.cache_end is not None and len(payload.messages) < s.cache_end:
        s.cache_end = None  # the history shrank (compacted): the last write's end is no longer in it
    attempt = Attempt(decision, s.addressed(decision.role, known), kwargs, payload, counted, s.cache_salt,
                      timeout_s=s.request_timeout_s, sent_at=s.stamp(), keeps_caller_salt=s.keeps_caller_salt,
                      routing_key=s.routing_key, headers=headers or {}, cache_end=s.cache_end)
    routed(s, attempt, opening=True)
    return attempt


def routed(s: SessionParts, attempt: Attempt, *, opening: bool = False) -> None:
    """``attempt``'s route decided (the turn's first, ``opening``, or after a recovery or a failover): the Session's
    last route, and the ``routed`` event."""
    s.last_route = attempt.decision
    escalation = is_escalation(s.recorder.previous_role, attempt.decision) if opening else False
    s.report(TurnEvent("routed", attempt, {"opening": opening, "escalation": escalation}))


def next_step(s: SessionParts, attempt: Attempt, outcome: Outcome | None) -> Action:
    """What ``attempt``'s turn does next (:func:`~agentkv._session.decide.next_action` over this Session's state)."""
    return next_action(attempt.decision, outcome, handed_off=attempt.handed_off, handoff_active=s.handoff.active,
                       previous_role=s.recorder.previous_role, has_slow=s.slow is not None, retry=s.retry,
                       streamed=attempt.turn.streamed, other_replica=_other_replica(s, attempt),
                       pooled=attempt.backend.label in s.replicas)


def _other_replica(s: SessionParts, attempt: Attempt) -> bool:
    """Whether ``attempt``'s backend is a pool with a replica besides this try's not found down this turn."""
    pool = s.replicas.get(attempt.backend.label)
    return pool is not None and any(url != attempt.backend.api_base and url not in attempt.turn.replicas_down
                                    for url in pool)


# ----------------------------------------------------------------- the handoff, at the answer

def hand_off(s: SessionParts, attempt: Attempt) -> Machine[None]:
    """The KV handoff before the escalated try: its plan (pure), then its engine kind's executor (torch work is
    offloaded, an export is a call); an import the plan makes goes on ``attempt``, counted at its answer."""
    if s.slow is None:
        return
    attempt.handed_off = True
    previous = s.history[-2] if len(s.history) > 1 else None  # what fast last served: cheap to export
    fast = s.addressed("fast")
    span = turns.handoff_span(attempt)
    plan = s.handoff.plan(fast, attempt.backend, attempt.payload, s.cache_salt, previous=previous,
                          headers=routing_headers(fast, s.routing_key), request=attempt.kwargs, raw=bool(attempt.raw))
    outcome = yield from s.handoff.execute(plan, http=s.http, warmed=s.warm.warmed, residency=s.warm.residency)
    if outcome.request is not None:
        attempt.kwargs, attempt.cache_salt = outcome.request.kwargs, outcome.request.cache_salt
        attempt.handoff_export = outcome.request.export  # per request: each escalation counts its own import
    s.report(TurnEvent("handed_off", attempt, {"span": span, "mapped_tokens": outcome.mapped_tokens,
                                               "fallback": outcome.fallback}))


def finish(s: SessionParts, attempt: Attempt, response: Any) -> Machine[Any]:
    """Record the answered ``attempt``: stats, the ledger row, the escalation, its import, its cached tokens (the
    ledger's prediction and the warm-prefix diagnostic are spawned, off the request path)."""
    s.handoff.answered(attempt.handoff_export, response, s.session_stats)  # what slow loaded for the import named
    escalation = is_escalation(s.recorder.previous_role, attempt.decision)
    warmed, warm_tokens = s.warm.warmed, s.warm.warmed_tokens
    expected = _expected_prefix(s, attempt, escalation)
    prediction = yield from _predict(s, attempt)

    if escalation and s.slow is not None:
        hosted.tally(s, s.backend("slow"), None, escalated=True)
    answered = {"escalation": escalation, "warmed": warmed is not None, "warm_tokens": warm_tokens,
                "expected": expected, "prediction": prediction}
    result = s.recorder.finish(attempt, response, escalation=escalation, after_warm=warmed is not None,
                               event=TurnEvent("answered", attempt, answered),
                               pooled=attempt.backend.label in s.replicas)
    if escalation and warmed is not None:  # the broken-warm diagnostic, off the request path
        yield from checking_warm_prefix(s.counter(attempt.backend), warmed, attempt.payload, s.session_stats,
                                        s.session_id)
    return result



def _expected_prefix(s: SessionParts, attempt: Attempt, escalation: bool) -> int | None:
    """The prefix a slow turn should find cached: what the warm sent before an escalation, else the previous slow
    turn's prompt (None for a fast turn, or with nothing to expect)."""
    if attempt.decision.role != "slow":
        return None
    return s.warm.warmed_tokens if escalation else s.slow_prompt_tokens


def _predict(s: SessionParts, attempt: Attempt) -> Machine[Prediction | None]:
    """Start the ledger's prediction for a request to a backend it follows (worked out in the background)."""
    ledger, sent_at = s.cache_ledger, attempt.sent_at
    if ledger is None or sent_at is None or not ledger.follows(attempt.backend):
        return None
    prediction = Prediction(ledger, attempt.backend, s.session_stats)
    yield from predicting(prediction, s.counter(attempt.backend), attempt.payload, attempt.cache_salt, sent_at)
    return prediction
