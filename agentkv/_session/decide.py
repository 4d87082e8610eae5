"""What a turn does next: one pure decision over an attempt and what happened to it.

Every way into a request (``Session.completion`` and ``acompletion``, the OpenAI transport's two twins, the
gateway's relay) runs the same loop (:func:`agentkv._session.turn.turn`), and that loop does what :func:`next_action`
says and nothing else, as tenacity's ``Retrying.__call__`` does what ``BaseRetrying.iter`` says:

- nothing has happened yet: :class:`HandOff` when the try is the escalation and a KV handoff is configured (once),
  else :class:`Send`;
- an answer came: :class:`Finish`;
- the try failed with a context overflow: :class:`Recover` (the driver gathers the failed backend's count and
  fresh window facts; :func:`~agentkv.routing.plan_recovery` then clamps, escalates or gives up);
- the try failed with an outage and there is another replica of the same pool or another backend: :class:`FailOver`
  (with fresh facts too: the conversation's next replica takes it, else :func:`~agentkv.routing.failover` decides
  whether the other backend can); also on a pool's last replica, whose failover ends the turn with the pool's
  exhaustion (:class:`~agentkv.errors.PoolExhaustedError`) and tells the replica's breaker what happened;
- anything else: :class:`GiveUp`, the error is the turn's answer.

No I/O, no clock, no logging: tests drive it with plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

from agentkv.overflow import Overflow, overflow_from_error
from agentkv.retry import RetryPolicy
from agentkv.routing import Role, RouteDecision, is_escalation

__all__ = ["Action", "Answered", "Failed", "FailOver", "Finish", "GiveUp", "HandOff", "Outcome", "Recover", "Send",
           "next_action"]

T = TypeVar("T")


@dataclass(frozen=True)
class Answered(Generic[T]):
    """The try was answered (a backend's success, or a stream whose first bytes arrived)."""

    value: T


@dataclass(frozen=True)
class Failed:
    """The try failed, after the retry policy's tries on that backend."""

    error: Exception


Outcome = Union[Answered[Any], Failed]


@dataclass(frozen=True)
class Send:
    """Send the attempt (its backend, its budget), retrying transient errors under the :class:`RetryPolicy`."""


@dataclass(frozen=True)
class HandOff:
    """Hand the conversation's KV to slow before the escalated try goes out (once per attempt)."""


@dataclass(frozen=True)
class Recover:
    """A context overflow: recount on the failed backend, gather fresh facts, clamp or escalate."""

    error: Exception
    overflow: Overflow


@dataclass(frozen=True)
class FailOver:
    """An outage: gather fresh facts and move the turn to the other backend when it can take it."""

    error: Exception


@dataclass(frozen=True)
class Finish(Generic[T]):
    """The turn is answered with ``value``."""

    value: T


@dataclass(frozen=True)
class GiveUp:
    """``error`` is the turn's answer: nothing recovers it."""

    error: Exception


Action = Union[Send, HandOff, Recover, FailOver, Finish[Any], GiveUp]


def next_action(decision: RouteDecision, outcome: Outcome | None, *, handed_off: bool, handoff_active: bool,
                previous_role: Role | None, has_slow: bool, retry: RetryPolicy, streamed: bool,
                other_replica: bool = False, pooled: bool = False) -> Action:
    """What the turn does next, given the attempt's ``decision`` and what happened to its last try (None before
    the first try of the attempt).

    ``handed_off``: the attempt's handoff already ran; ``handoff_active``: a KV mapper is configured;
    ``previous_role``: the role of the Session's last answered request (what makes this try the escalation);
    ``has_slow``: there is another backend to fail over to; ``other_replica``: the try's backend is a pool with a
    replica not yet found down this turn; ``pooled``: the try's backend is a pool's replica;
    ``streamed``: the caller asked for a stream (a read timeout then never counts as an outage)."""
    if outcome is None:
        if handoff_active and not handed_off and is_escalation(previous_role, decision):
            return HandOff()
        return Send()
    if isinstance(outcome, Answered):
        return Finish(outcome.value)
    error = outcome.error
    overflow = overflow_from_error(error)
    if overflow is not None:
        return Recover(error, overflow)
    if (has_slow or other_replica or pooled) and retry.fails_over(error, streamed=streamed):
        return FailOver(error)
    return GiveUp(error)
