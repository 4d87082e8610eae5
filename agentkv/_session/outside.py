"""The Session's entry points for requests it does not send itself, as functions over a
:class:`~agentkv._session.parts.SessionParts`: what :meth:`Session.presend` may vouch for before a count, and how a
request sent elsewhere (a LangChain callback, a litellm logger) is accounted (:meth:`Session.observe`).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from agentkv._session.attempts import Attempt
from agentkv._session.inputs import Facts, max_tokens_of, request_payload, to_facts
from agentkv._session.parts import SessionParts
from agentkv._session.gather import decides
from agentkv._session.steps import decide
from agentkv.backends import Backend
from agentkv.errors import ContextOverflowError
from agentkv.fleet import routing_headers
from agentkv.protocols import Observation
from agentkv.routing import RouteDecision, as_sent
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.ceiling import byte_ceiling
from agentkv.wire.openai import counted_view

__all__ = ["observation", "observed", "presend", "request_extras", "sent_to_role"]


def presend(s: SessionParts, body: Mapping[str, Any]) -> Attempt | None:
    """What :meth:`Session.presend` answers (see there): the attempt, or None when it cannot vouch for one."""
    if s.closed or s.slow is None or "cache_salt" in body or "extra_body" in body:
        return None
    if s.fast.is_pool or s.slow.is_pool:  # a pool's window is its replicas' smallest: not vouched for from one
        return None
    fast_info = s.discovery.recent(s.fast, model_known=False)
    slow_info = s.discovery.recent(s.slow)
    if fast_info is None or slow_info is None or not s.counter(s.fast).bound.trusts_ceiling:
        return None
    kwargs = counted_view(body)
    try:
        max_tokens = max_tokens_of(kwargs)
        payload = request_payload(kwargs, s.backends(), s.counters.values())
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
                   keeps_caller_salt=s.keeps_caller_salt, routing_key=s.routing_key, raw_body=dict(body))


def request_extras(s: SessionParts, backend: Backend) -> dict[str, Any]:
    """What :meth:`Session.request_extras` answers: the salt a self-hosted ``backend`` must find in the body, and the
    routing headers a router reads (each only where there is one)."""
    extras: dict[str, Any] = {}
    if backend.self_hosted and isinstance(s.cache_salt, str):
        extras["extra_body"] = {"cache_salt": s.cache_salt}
    headers = routing_headers(backend, s.routing_key)
    if headers:
        extras["extra_headers"] = headers
    return extras


def sent_to_role(s: SessionParts, sent_to: str) -> Literal["fast", "slow"]:
    if sent_to == "fast" or (sent_to == "slow" and s.slow is not None):
        return "slow" if sent_to == "slow" else "fast"
    raise ValueError(f"sent_to must be 'fast' or 'slow' (with a slow backend), got {sent_to!r}")


def observed(s: SessionParts, kwargs: dict[str, Any], payload: Payload, count: TokenCount, facts: Facts,
             role: Literal["fast", "slow"]) -> tuple[Attempt, RouteDecision | None]:
    try:
        decision: RouteDecision | None = decide(s, kwargs, count, facts)
    except ContextOverflowError:
        decision = None
    target = facts.fast if role == "fast" else facts.slow
    sent = as_sent(target, role, input_tokens=count.total, max_tokens=max_tokens_of(kwargs), count_source=count.source)
    return Attempt(sent, s.backend(role), kwargs, payload, count, s.cache_salt,
                   keeps_caller_salt=s.keeps_caller_salt), decision


def observation(s: SessionParts, attempt: Attempt, decision: RouteDecision | None, facts: Facts) -> Observation:
    target = facts.fast if attempt.decision.role == "fast" else facts.slow
    entry = s.recorder.observed(attempt.count, target.name, attempt.warm)
    return Observation(entry.turn, attempt.count, decision, facts.fast.window, attempt.warm, facts.slow.window)
