"""A turn, written once: machines (:mod:`agentkv._support.effects`) that every entry point runs with the sync or the
async driver, as h11's protocol objects serve any socket.

- :func:`opening`: a request's inputs (window facts, fast's count), its plan (the pure core routes and clamps), and
  its warm-ahead, in the order they happen;
- :func:`turn`: the loop that does what :func:`~agentkv._session.decide.next_action` says: send (each try under the
  :class:`~agentkv.RetryPolicy`: a transient failure is retried after a :class:`~agentkv._support.effects.Wait` the
  policy decides, as tenacity's ``iter`` does), hand the KV off, recover an overflow or fail over (each with fresh
  window facts and the failed backend's own count), finish or give up. It catches nothing to decide: a try's failure
  comes back as a value (:class:`~agentkv._support.effects.Raised`), and a recovery that finds no backend returns
  :class:`~agentkv._session.decide.GiveUp`;
- :func:`next_try`: one recovery step (what :meth:`Session.recover` exposes).

    ended = run(turn(parts, attempt, send, streamed=False, retries=True), parts.jobs)
    ended.result()   # the answer, or raises what ended the turn
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, TypeVar

from agentkv._session import gather, reactive, steps, warming
from agentkv._session.attempts import Attempt
from agentkv._session.decide import Answered, Failed, FailOver, Finish, GiveUp, HandOff, Outcome, Recover, Send
from agentkv._session.parts import SessionParts
from agentkv._session.pipeline import TurnEvent
from agentkv._support.effects import Call, Machine, Raised, Wait
from agentkv.retry import log_retry
from agentkv.telemetry import turns
from agentkv.telemetry.otel import ended as span_ended
from agentkv.tokens import Payload

__all__ = ["TurnEnd", "next_try", "opening", "turn"]

T = TypeVar("T")


@dataclass
class TurnEnd(Generic[T]):
    """How a turn ended: its last ``attempt`` and the ``answer`` it got, or the ``error`` that is its answer (the last
    try's failure, or what the recovery found, e.g. a :class:`~agentkv.ContextOverflowError`)."""

    attempt: Attempt
    answer: T | None = None
    error: Exception | None = None

    def result(self) -> T:
        """The answer, or raise the error that ended the turn."""
        if self.error is not None:
            raise self.error
        return self.answer  # type: ignore[return-value]


def opening(s: SessionParts, kwargs: dict[str, Any], payload: Payload, *,
            headers: Mapping[str, str] | None = None, raw_body: Mapping[str, Any] | None = None) -> Machine[Attempt]:
    """The turn's first attempt: facts gathered, fast's count, routed and clamped, and warm-ahead considered (a warm
    goes out in the background)."""
    known = yield from gather.facts(s)
    counted = yield from gather.count(s, kwargs, payload, known)
    attempt = steps.plan(s, kwargs, payload, counted, known, headers=headers)
    attempt.raw, attempt.raw_body = raw_body is not None, raw_body
    yield from warming.maybe_warm(s, attempt, known)
    yield from gather.watch_warm_replica(s, attempt)
    return attempt


def turn(s: SessionParts, attempt: Attempt, send: Callable[[Attempt], Any], *, streamed: bool,
         retries: bool = True) -> Machine[TurnEnd[Any]]:
    """Carry ``attempt``'s turn to its end; ``send`` makes one try (a plain function under the sync driver, a
    coroutine function under the async one). ``retries=False``: each try is sent once (a sender that retries on its
    own), whatever ``s.retry`` says."""
    attempt.turn.streamed = streamed
    outcome: Outcome | None = None
    while True:
        action = steps.next_step(s, attempt, outcome)
        if isinstance(action, Finish):
            return TurnEnd(attempt, answer=action.value)
        if isinstance(action, HandOff):
            yield from steps.hand_off(s, attempt)  # torch work offloaded off the event loop, an export a call
            continue
        if isinstance(action, Send):
            outcome = yield from _tried(s, attempt, send, retries)
            continue
        moved = action if isinstance(action, GiveUp) else (yield from next_try(s, attempt, action))
        if isinstance(moved, GiveUp):
            s.report(TurnEvent("failed", attempt, {"error": moved.error}))
            return TurnEnd(attempt, error=moved.error)
        attempt, outcome = moved, None


def next_try(s: SessionParts, attempt: Attempt, action: Recover | FailOver) -> Machine[Attempt | GiveUp]:
    """The try after ``attempt`` failed: an overflow clamped or escalated (on the failed backend's own count), an
    outage failed over (its replica reported to the pool's breaker), each on fresh facts; or :class:`GiveUp`."""
    if isinstance(action, Recover):
        count = yield from gather.recount(s, attempt)
        known = yield from gather.facts(s)
        return reactive.recover(s, attempt, action.error, action.overflow, count, known)
    yield from gather.eject(s, attempt, action.error)
    known = yield from gather.facts(s)
    return reactive.fail_over(s, attempt, action.error, known)


def _tried(s: SessionParts, attempt: Attempt, send: Callable[[Attempt], Any], retries: bool) -> Machine[Outcome]:
    """One Send: tries of ``send`` on the attempt's backend, each counted as a try of the turn, a transient failure
    retried after the wait the retry policy decides."""
    role, policy, pooled = attempt.decision.role, s.retry, attempt.backend.label in s.replicas
    limit = policy.limit(attempt.turn.left(role, policy.attempts)) if retries else 1
    tries = 0
    while True:
        tries += 1
        attempt.turn.sent[role] += 1
        span = turns.try_span(attempt)
        result = yield Call(send, send, (attempt,), captures=True)
        if not isinstance(result, Raised):
            span_ended(span)
            _answered_by(s, attempt, pooled)
            return Answered(result.value)
        span_ended(span, error=result.error)
        delay = policy.retry_after(result.error, tries=tries, limit=limit, outages=not pooled)
        if delay is None:
            return Failed(result.error)
        log_retry(result.error, tries=tries, delay_s=delay)
        yield Wait(delay, policy.sleep, policy.asleep)


def _answered_by(s: SessionParts, attempt: Attempt, pooled: bool) -> None:
    """A pool's replica answered the try: its breaker's streak of failures starts again (no I/O)."""
    if pooled and attempt.backend.api_base is not None:
        s.ejections.judge(attempt.backend.api_base, "ok", session=s.session_id, tenant=s.tenant)
