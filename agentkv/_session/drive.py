"""The one loop every entry point runs a turn with, sync (:func:`run`) and async (:func:`arun`).

A caller prepares the turn's first :class:`~agentkv._session.attempts.Attempt` (``Session.prepare``, or the
Session's own drivers) and hands over how one try goes out: ``send(attempt)`` returns the backend's answer or
raises. The loop asks :func:`~agentkv._session.decide.next_action` what to do and does it: send (under the Session's
:class:`~agentkv.RetryPolicy`, at most ``attempts`` tries per backend in a turn), hand the KV off, recover an overflow
or fail over (each with fresh window facts and the failed backend's own count), finish or give up. It decides nothing
itself, so ``Session.completion``, the OpenAI transport and the gateway route, recover and fail over alike.

    ended = run(session, attempt, lambda a: client.completion(**a.call_kwargs), streamed=False)
    ended.result()   # the answer, or raises what ended the turn
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Generic, TypeVar

from agentkv._session import steps
from agentkv._session.attempts import Attempt
from agentkv._session.decide import Answered, Failed, FailOver, Finish, GiveUp, HandOff, Outcome, Recover, Send
from agentkv._session.reactive import fail_over, recover
from agentkv._session.state import SessionState
from agentkv.retry import RetryPolicy
from agentkv.telemetry import turns
from agentkv.telemetry.otel import ended

__all__ = ["TurnEnd", "arun", "run"]

T = TypeVar("T")


@dataclass
class TurnEnd(Generic[T]):
    """How a turn ended: its last ``attempt`` and the ``answer`` it got, or the ``error`` that is its answer (the last
    try's failure, or what the recovery raised from it, e.g. a :class:`~agentkv.ContextOverflowError`)."""

    attempt: Attempt
    answer: T | None = None
    error: Exception | None = None

    def result(self) -> T:
        """The answer, or raise the error that ended the turn."""
        if self.error is not None:
            raise self.error
        return self.answer  # type: ignore[return-value]


def run(session: SessionState, attempt: Attempt, send: Callable[[Attempt], T], *, streamed: bool,
        retries: bool = True) -> TurnEnd[T]:
    """Carry ``attempt``'s turn to its end through ``session``'s decisions; ``send`` makes one try. ``retries=False``:
    each try is sent once (a sender that retries on its own), whatever ``session.retry`` says."""
    attempt.turn.streamed = streamed
    outcome: Outcome | None = None
    while True:
        action = steps.next_step(session, attempt, outcome)
        if isinstance(action, Finish):
            return TurnEnd(attempt, answer=action.value)
        if isinstance(action, GiveUp):
            turns.failed(attempt, action.error)
            return TurnEnd(attempt, error=action.error)
        if isinstance(action, HandOff):
            steps.hand_off(session, attempt)
            continue
        if isinstance(action, Send):
            outcome = _tried(session, attempt, send, retries)
            continue
        try:
            if isinstance(action, Recover):
                attempt = recover(session, attempt, action.error, action.overflow, steps.recount(session, attempt),
                                  steps.facts(session))
            elif isinstance(action, FailOver):
                steps.eject(session, attempt, action.error)
                attempt = fail_over(session, attempt, action.error, steps.facts(session))
        except Exception as final:  # no backend takes the turn: what the recovery raised is its answer
            turns.failed(attempt, final)
            return TurnEnd(attempt, error=final)
        outcome = None


async def arun(session: SessionState, attempt: Attempt, send: Callable[[Attempt], Awaitable[T]], *,
               streamed: bool, retries: bool = True) -> TurnEnd[T]:
    """The async twin of :func:`run`: every input is awaited, and the handoff's torch work runs off the loop."""
    attempt.turn.streamed = streamed
    outcome: Outcome | None = None
    while True:
        action = steps.next_step(session, attempt, outcome)
        if isinstance(action, Finish):
            return TurnEnd(attempt, answer=action.value)
        if isinstance(action, GiveUp):
            turns.failed(attempt, action.error)
            return TurnEnd(attempt, error=action.error)
        if isinstance(action, HandOff):
            await asyncio.to_thread(steps.hand_off, session, attempt)
            continue
        if isinstance(action, Send):
            outcome = await _atried(session, attempt, send, retries)
            continue
        try:
            if isinstance(action, Recover):
                attempt = recover(session, attempt, action.error, action.overflow,
                                  await steps.arecount(session, attempt), await steps.afacts(session))
            elif isinstance(action, FailOver):
                await steps.aeject(session, attempt, action.error)
                attempt = fail_over(session, attempt, action.error, await steps.afacts(session))
        except Exception as final:
            turns.failed(attempt, final)
            return TurnEnd(attempt, error=final)
        outcome = None


def _tried(session: SessionState, attempt: Attempt, send: Callable[[Attempt], T], retries: bool) -> Outcome:
    """One Send: ``send`` under the retry policy, each call counted as a try of the turn on the attempt's backend."""
    role, policy = attempt.decision.role, _policy(session, retries)

    def once() -> T:
        attempt.turn.sent[role] += 1
        span = turns.try_span(attempt)
        try:
            answer = send(attempt)
        except BaseException as error:
            ended(span, error=error)
            raise
        ended(span)
        return answer

    try:
        answer = policy.call(once, attempts=attempt.turn.left(role, policy.attempts), outages=not _pooled(session, attempt))
    except Exception as error:
        return Failed(error)
    _answered_by(session, attempt)
    return Answered(answer)


async def _atried(session: SessionState, attempt: Attempt, send: Callable[[Attempt], Awaitable[T]],
                  retries: bool) -> Outcome:
    role, policy = attempt.decision.role, _policy(session, retries)

    async def once() -> T:
        attempt.turn.sent[role] += 1
        span = turns.try_span(attempt)
        try:
            answer = await send(attempt)
        except BaseException as error:
            ended(span, error=error)
            raise
        ended(span)
        return answer

    try:
        answer = await policy.acall(once, attempts=attempt.turn.left(role, policy.attempts),
                                    outages=not _pooled(session, attempt))
    except Exception as error:
        return Failed(error)
    _answered_by(session, attempt)
    return Answered(answer)


def _answered_by(session: SessionState, attempt: Attempt) -> None:
    """A pool's replica answered the try: its breaker's streak of failures starts again (no I/O)."""
    if _pooled(session, attempt) and attempt.backend.api_base is not None:
        session.ejections.judge(attempt.backend.api_base, "ok", session=session.session_id, tenant=session.tenant)


def _pooled(session: SessionState, attempt: Attempt) -> bool:
    """The try goes to a pool's replica: an outage there is not retried on it (the next replica takes the turn)."""
    return attempt.backend.label in session.replicas


def _policy(session: SessionState, retries: bool) -> RetryPolicy:
    """The Session's retry policy, or the same sending each try once (the turn's bounds unchanged)."""
    policy = session.retry
    return policy if retries or not policy.retry_transient else replace(policy, retry_transient=False)
