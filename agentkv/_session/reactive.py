"""The next try after a failed one, as functions over a :class:`~agentkv._session.parts.SessionParts`: after a context
overflow (clamp or escalate: the pure :func:`~agentkv.routing.plan_recovery` and :func:`~agentkv.routing.after_recovery`
decide) or after an outage (fail over: :func:`~agentkv.routing.failover` decides). The loop
(:func:`agentkv._session.turn.turn`) gathers the inputs (the failed backend's count, fresh :class:`Facts`) and hands them
over as data.
"""

from __future__ import annotations

from dataclasses import replace
from agentkv._session.attempts import Attempt
from agentkv._session.decide import GiveUp
from agentkv._session.inputs import Facts, max_tokens_of
from agentkv._session.parts import SessionParts
from agentkv._session.pipeline import TurnEvent
from agentkv._session.steps import routed
from agentkv.errors import ContextOverflowError, PoolExhaustedError
from agentkv.http.transport import redact_url
from agentkv.backends import Backend
from agentkv.events import emit
from agentkv.fleet import choose
from agentkv.overflow import Overflow
from agentkv.routing import Target, after_recovery, failover, plan_recovery
from agentkv.tokens import TokenCount

__all__ = ["fail_over", "recover"]


def recover(s: SessionParts, attempt: Attempt, error: Exception, overflow: Overflow, count: TokenCount,
            facts: Facts) -> Attempt | GiveUp:
    """The next try after ``attempt`` overflowed with ``error``: clamped, escalated, or none (:class:`GiveUp` with a
    :class:`~agentkv.ContextOverflowError` caused by ``error``). ``count``: the failed backend's own count of the
    request (exact where it can be)."""
    role = attempt.decision.role
    failed = facts.fast if role == "fast" else facts.slow
    if overflow.max_context:
        s.discovery.correct(attempt.backend, overflow.max_context)
    attempt.turn.refused.add(role)  # a clamp may retry it with less output; a failover never returns to it
    facts = _for_turn(s, facts, attempt, exclude_refused=False)
    plan = plan_recovery(
        overflow, role=role, exact_prompt_tokens=count.total if count.exact else None,
        requested_max_tokens=attempt.decision.max_tokens, known_window=failed.window, safe_prompt_tokens=count.safe,
        already_clamped=attempt.reactive_clamped or not attempt.turn.left(role, s.retry.attempts),
        slow_usable=facts.slow.usable and role == "fast", policy=s.routing,
    )
    s.report(TurnEvent("overflowed", attempt, {"variant": overflow.variant, "action": plan.action, "why": plan.why,
                                               "server_window": overflow.max_context, "prompt": plan.prompt_tokens}))
    if plan.action == "give_up":
        windows = {facts.fast.name: facts.fast.window}
        if s.slow is not None:
            windows[facts.slow.name] = facts.slow.window
        windows[failed.name] = overflow.max_context or failed.window
        closed = attempt.turn.closed("slow", s.retry.attempts) if role == "fast" and s.slow else ""
        why = f"{facts.slow.name!r} {closed}" if closed else plan.why
        return GiveUp(_caused(ContextOverflowError(
            f"{attempt.backend.label!r} rejected the request as too long and no backend can take it: {why}",
            input_tokens=plan.prompt_tokens or attempt.count.total, windows=windows,
            max_tokens=attempt.decision.max_tokens,
        ), error))
    attempt.turn.recoveries += 1
    s.report(TurnEvent("recovered", attempt, {"action": plan.action, "variant": overflow.variant}))
    fast = replace(facts.fast, window=overflow.max_context or facts.fast.window) \
        if attempt.decision.role == "fast" else facts.fast
    try:
        decision = after_recovery(attempt.decision, plan, fast=fast, slow=facts.slow, policy=s.routing,
                                  requested_max_tokens=max_tokens_of(attempt.kwargs), safe_tokens=attempt.count.safe)
    except ContextOverflowError as refused:  # the escalation finds slow too small for what the server counted
        return GiveUp(_caused(refused, error))
    escalated = decision.role != attempt.decision.role
    backend = s.addressed(decision.role, facts, attempt.turn.replicas_down) if escalated else attempt.backend
    moved = replace(attempt, decision=decision, backend=backend, reactive_clamped=not escalated)
    routed(s, moved)
    return moved


def fail_over(s: SessionParts, attempt: Attempt, error: Exception, facts: Facts) -> Attempt | GiveUp:
    """The next try when ``attempt``'s backend is down (``error`` is an outage:
    :func:`~agentkv._session.decide.next_action` said so): the conversation's next replica of a pool, else the other
    backend when it can take the request. When neither can (the other backend is closed for this turn: down, refused
    this request as too long, or out of tries, see :class:`~agentkv.retry.TurnTries`; or it cannot hold it), ``error``
    ends the turn: as it is, or, when the failed backend is a pool, as the cause of a
    :class:`~agentkv.errors.PoolExhaustedError` naming each replica's state."""
    moved = _next_replica(s, attempt, facts)
    if moved is not None:
        return _moved(s, attempt, error, moved)
    if s.slow is None:
        return _give_up(s, attempt, error, facts)
    attempt.turn.down.add(attempt.decision.role)
    facts = _for_turn(s, facts, attempt, exclude_refused=True)
    decision = failover(attempt.decision, fast=facts.fast, slow=facts.slow, policy=s.routing,
                        route_tokens=attempt.count.total, safe_tokens=attempt.count.safe,
                        max_tokens=max_tokens_of(attempt.kwargs))
    if decision is None:
        return _give_up(s, attempt, error, facts)
    attempt.turn.failovers += 1
    s.report(TurnEvent("failed_over", attempt, {"error": error, "to": decision.backend}))
    other = replace(attempt, decision=decision, backend=s.addressed(decision.role, facts, attempt.turn.replicas_down),
                    failed_over=True, reactive_clamped=False)
    routed(s, other)
    return other


def _next_replica(s: SessionParts, attempt: Attempt, facts: Facts) -> Backend | None:
    """The conversation's next replica of the failed try's pool (not down, not found down this turn), or None."""
    if attempt.backend.label not in s.replicas or attempt.turn.closed(attempt.decision.role, s.retry.attempts,
                                                                      refusal_closes=False):
        return None
    pool = s.backend(attempt.decision.role)
    url = choose(s.routing_key, pool.replicas, down=facts.down, tried={*attempt.turn.replicas_down,
                                                                        attempt.backend.api_base or ""})
    return None if url is None else s.replicas[pool.label][url]


def _give_up(s: SessionParts, attempt: Attempt, error: Exception, facts: Facts) -> GiveUp:
    """End a turn no backend took after ``error``: when the failed backend is a pool, with a
    :class:`~agentkv.errors.PoolExhaustedError` naming each replica's state this turn (``error`` its cause); else with
    ``error`` itself."""
    pool = s.replicas.get(attempt.backend.label)
    if pool is None:
        return GiveUp(error)
    states = {redact_url(url): _replica_state(s, attempt, url, facts) for url in pool}
    emit("pool_exhausted", level="warning", pool=attempt.backend.label, replicas=states, session=s.session_id,
         tenant=s.tenant)
    return GiveUp(_caused(PoolExhaustedError(attempt.backend.label, states), error))


def _caused(error: Exception, cause: Exception) -> Exception:
    """``error`` raised ``from cause`` (as its ``__cause__``), without raising it."""
    error.__cause__, error.__suppress_context__ = cause, True
    return error


def _replica_state(s: SessionParts, attempt: Attempt, url: str, facts: Facts) -> str:
    """What happened to the pool's replica ``url`` this turn: how its try failed, else why it was not tried."""
    failed = attempt.turn.replica_failures.get(url)
    if failed is not None:
        return failed
    if url in facts.down:
        left = s.ejections.cooling_s(url)
        return f"ejected (cooling off {left:.0f} s)" if left else "ejected"
    return "not tried"


def _moved(s: SessionParts, attempt: Attempt, error: Exception, replica: Backend) -> Attempt:
    """The same try on the conversation's next replica: the same route and budget, no tier change."""
    s.report(TurnEvent("replica_failed_over", attempt, {
        "error": error, "to": replica.label, "failed": redact_url(attempt.backend.api_base or ""),
        "to_url": redact_url(replica.api_base or "")}))
    return replace(attempt, backend=replica)


def _for_turn(s: SessionParts, facts: Facts, attempt: Attempt, *, exclude_refused: bool) -> Facts:
    """``facts`` with the backends this turn may no longer use marked unusable (the refusal rule applies to a
    failover; a recovery's own clamp may retry the backend that refused, with less output)."""
    turn, attempts = attempt.turn, s.retry.attempts

    def target(t: Target, role: str) -> Target:
        why = turn.closed(role, attempts, refusal_closes=exclude_refused)
        return replace(t, usable=False, why_unusable=why) if why and t.usable else t

    return replace(facts, fast=target(facts.fast, "fast"), slow=target(facts.slow, "slow"))
