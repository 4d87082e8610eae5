"""The Session's entry points for requests it does not send itself, as functions over a
:class:`~agentkv._session.state.SessionState`: what :meth:`Session.presend` may vouch for before a count, and how a
request sent elsewhere (a LangChain callback, a litellm logger) is accounted (:meth:`Session.observe`).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from agentkv._session.attempts import Attempt
from agentkv._session.inputs import Facts, max_tokens_of, request_payload, to_facts
from agentkv._session.state import SessionState
from agentkv._session.steps import decide, decides
from agentkv.errors import ContextOverflowError
from agentkv.protocols import Observation
from agentkv.routing import RouteDecision, as_sent
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.ceiling import byte_ceiling

__all__ = ["observation", "observed", "presend", "sent_to_role"]


def presend(s: SessionState, body: Mapping[str, Any]) -> Attempt | None:
    """What :meth:`Session.presend` answers (see there): the attempt, or None when it cannot vouch for one."""
    if s.closed or s.slow is None or "cache_salt" in body or "extra_body" in body:
        return None
    if s.fast.is_pool or s.slow.is_pool:  # a pool's window is its replicas' smallest: not vouched for from one
        return None
    fast_info = s.discovery.recent(s.fast, model_known=False)
    slow_info = s.discovery.recent(s.slow)
    if fast_info is None or slow_info is None or not s._counter(s.fast).bound.trusts_ceiling:
        return None
    kwargs = dict(body)
    try:
        max_tokens = max_tokens_of(kwargs)
        payload = request_payload(kwargs, s._backends(), s.counters.values())
    except (ValueError, TypeError):  # InvalidRequestError is a ValueError: aprepare reports it
        return None
    ceiling = byte_ceiling(payload)
    facts = to_facts(s.fast, s.slow, fast_info, slow_info)
    if ceiling is None or not decides(s, kwargs, facts)(0, ceiling):
        return None
    count = TokenCount(ceiling, ceiling, 0, "ceiling", False, 0, ceiling)
    try:
        decision = decide(s, kwargs, count, facts)
    except ContextOverflowError:
        return None
    if decision.role != "fast" or decision.reason != "fits" or decision.max_tokens != max_tokens:
        return None
    return Attempt(decision, s.fast, kwargs, payload, count, s.cache_salt, raw=True,
                   keeps_caller_salt=s._keeps_caller_salt, routing_key=s.routing_key)


def sent_to_role(s: SessionState, sent_to: str) -> Literal["fast", "slow"]:
    if sent_to == "fast" or (sent_to == "slow" and s.slow is not None):
        return "slow" if sent_to == "slow" else "fast"
    raise ValueError(f"sent_to must be 'fast' or 'slow' (with a slow backend), got {sent_to!r}")


def observed(s: SessionState, kwargs: dict[str, Any], payload: Payload, count: TokenCount, facts: Facts,
             role: Literal["fast", "slow"]) -> tuple[Attempt, RouteDecision | None]:
    try:
        decision: RouteDecision | None = decide(s, kwargs, count, facts)
    except ContextOverflowError:
        decision = None
    target = facts.fast if role == "fast" else facts.slow
    sent = as_sent(target, role, input_tokens=count.total, max_tokens=max_tokens_of(kwargs), count_source=count.source)
    return Attempt(sent, s._backend(role), kwargs, payload, count, s.cache_salt,
                   keeps_caller_salt=s._keeps_caller_salt), decision


def observation(s: SessionState, attempt: Attempt, decision: RouteDecision | None, facts: Facts) -> Observation:
    target = facts.fast if attempt.decision.role == "fast" else facts.slow
    entry = s._record.observed(attempt.count, target.name, attempt.warm)
    return Observation(entry.turn, attempt.count, decision, facts.fast.window, attempt.warm, facts.slow.window)
