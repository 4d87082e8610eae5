"""Warm-ahead at a turn: consider it for the request (the policy decides, the state store's claim bounds it), plan the
warm (:class:`~agentkv.warm.sender.WarmPlan`: what it sends to where this conversation's escalation would go, a pool's
replica for it) and spawn the sender's executor on that plan.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Mapping

import agentkv._support.env as _env
from agentkv._session import hosted
from agentkv._session.attempts import Attempt, raw_warm_target, warm_body, warm_kwargs
from agentkv._session.inputs import Facts
from agentkv._session.parts import SessionParts
from agentkv._session.pipeline import TurnEvent
from agentkv._support.effects import Machine, Spawn
from agentkv.backends import Backend
from agentkv.fleet import routing_headers
from agentkv.telemetry import turns
from agentkv.warm.sender import Claimed, WarmPlan, WarmRequest

__all__ = ["maybe_warm", "rewarm_moved"]


def maybe_warm(s: SessionParts, attempt: Attempt, known: Facts) -> Machine[None]:
    """Consider warm-ahead for ``attempt`` and, when due, spawn its plan's executor (in the background)."""
    if s.slow is not None:
        slow = _warm_target(s, known)
        claim = yield from s.warm.considering(attempt.payload, **_warm_inputs(s, attempt, known, slow))
        attempt.warm = claim.outcome
        yield from _sending(s, attempt, slow, claim)
        s.report(TurnEvent("warmed", attempt, {"outcome": claim.outcome, "check": claim.check}))


def _warm_target(s: SessionParts, known: Facts) -> Backend:
    """Where this conversation's escalation would go now: a pool's replica for it (a warm there is claimed apart from
    one on another replica, so a conversation moved off a replica that went down is warmed again on its new one)."""
    slow = s.addressed("slow", known)
    s.warm.retarget(slow.api_base if s.backend("slow").is_pool else None)
    if s.residency is not None and s.backend("slow").is_pool:  # the ledger's view of this conversation's replica
        followed = s.residency.ledger.follows(slow)
        if followed:
            s.residency.backend = slow
        s.warm.follow(s.residency if followed else None)  # a replica it does not follow: the cooldown decides
    return slow


def _warm_inputs(s: SessionParts, attempt: Attempt, known: Facts, slow: Backend) -> dict[str, Any]:
    boundary = None if known.fast.window is None else known.fast.window - s.routing.output_floor
    return dict(estimated_tokens=attempt.count.total, fast_window=known.fast.window,
                routed_role=attempt.decision.role, model_known=known.slow_model_known,
                enabled=_env.warm_ahead_enabled(), boundary_tokens=boundary, **hosted.inputs(s, slow))


def rewarm_moved(s: SessionParts, attempt: Attempt, known: Facts) -> Machine[None]:
    """(A health check's job) ``attempt``'s conversation lost the replica its warm sat on (``known`` has it down):
    warm its next replica now."""
    slow = _warm_target(s, known)
    claim = yield from s.warm.moving(attempt.payload, attempt.count.total)
    if claim.outcome == "fire":
        yield from _sending(s, replace(attempt, warm="fire"), slow, claim)


def _sending(s: SessionParts, attempt: Attempt, slow: Backend, claim: Claimed) -> Machine[None]:
    """Plan the claimed warm and spawn its executor; a warm that cannot be built gives its claim back."""
    if not claim.sends:
        return
    try:
        plan = _planned(s, attempt, slow, claim)
    except Exception as exc:  # building a warm never raises into the caller
        yield from s.warm.abandoning(claim, exc)
        return
    yield Spawn(partial(s.warm.sending, plan, s.http, s.client), s.warm.timeout_s(plan))


def _planned(s: SessionParts, attempt: Attempt, slow: Backend, claim: Claimed) -> WarmPlan:
    """What the warm sends: the same bytes as the request in a raw POST where the slow server takes one, else a
    one-token litellm call (a managed slow's next requests then mark where this warm wrote)."""
    text = attempt.text  # a text completion warms ``/completions`` with its prompt
    url = raw_warm_target(slow, text=text)
    trace = None if attempt.span is None else (attempt.span, turns.warm_attributes(slow, attempt.count.total))
    plan = WarmPlan(claim, WarmRequest(), replica=s.warm.replica, trace=trace,
                    residency=s.warm.residency if claim.check else None)
    if url is None and text:
        raise ValueError("a text completion is warmed only by a raw POST to a self-hosted slow backend")
    if url is not None:
        body = warm_body(slow, attempt.kwargs, s.cache_salt, raw=attempt.raw,
                         keep_caller_salt=attempt.keeps_caller_salt, routing_key=s.routing_key)
        caller = attempt.headers if attempt.raw else attempt.kwargs.get("extra_headers")
        headers = routing_headers(slow, s.routing_key, caller if isinstance(caller, Mapping) else None)
        return replace(plan, request=WarmRequest(url=url, body=body, headers=headers))
    call = warm_kwargs(slow, attempt.kwargs, s.cache_salt, s.warm_ahead.timeout_s,
                       keep_caller_salt=attempt.keeps_caller_salt, routing_key=s.routing_key)
    if attempt.payload.messages is not None:
        s.cache_end = len(attempt.payload.messages)
    return replace(plan, request=WarmRequest(call=call), accounted=None if slow.self_hosted else slow)
