"""Routing decisions as pure functions of token counts and windows.

``decide_route`` says where a request goes before anything is sent; ``plan_recovery`` says what to do
after a backend answered with a context-overflow error and ``after_recovery`` turns that plan into the
next try's decision; ``escalate`` is the one composition of a move to slow (proactive or reactive);
``slow_target`` holds the cloud-catalog rule; ``as_sent`` describes a request another framework sent;
``is_escalation`` says which answered request was the move to slow; ``interval_decides`` says whether an
estimated count is enough, or the exact one is needed. None does I/O, sleeps or logs:
the Session gathers the inputs and carries the decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from agentkv.errors import ContextOverflowError, check_positive_int
from agentkv.overflow import Overflow

__all__ = ["Recovery", "Role", "RouteDecision", "RoutePolicy", "Target", "after_recovery", "as_sent", "check_fits_slow",
           "decide_route", "escalate", "failover", "interval_decides", "is_escalation", "no_slow_target", "plan_recovery",
           "slow_budget", "slow_target"]

Reason = Literal["fits", "proactive", "clamped", "reactive_clamp", "reactive_escalate", "observed", "failover"]
Role = Literal["fast", "slow"]


@dataclass(frozen=True)
class RoutePolicy:
    """How close to a window a request may go.

    ``output_floor``: output tokens every request must have room for (a request whose input plus the
    floor exceeds the fast window goes to slow). ``min_output``: the smallest output budget a clamp may
    leave; below it the request escalates instead.

        RoutePolicy(output_floor=256, min_output=256)
    """

    output_floor: int = 256
    min_output: int = 256

    def __post_init__(self) -> None:
        for name in ("output_floor", "min_output"):
            check_positive_int("RoutePolicy", name, getattr(self, name))


@dataclass(frozen=True)
class Target:
    """A backend as routing sees it: its label, its window (None if unknown), and whether it may be used."""

    name: str
    window: int | None
    usable: bool = True
    why_unusable: str = ""


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why.

    ``backend``: the chosen backend's name; ``role``: "fast" or "slow"; ``reason``: "fits",
    "proactive", "clamped", "reactive_clamp" or "reactive_escalate"; ``estimated_input_tokens``: the
    count routing used; ``window``: the chosen backend's window; ``max_tokens``: what is sent
    (None: the caller set none); ``count_source``: which token source counted; ``note``: why a
    reroute was declined, if one was.
    """

    backend: str
    role: Role
    reason: Reason
    estimated_input_tokens: int
    window: int | None
    max_tokens: int | None
    count_source: str = ""
    note: str = ""


def decide_route(
    *,
    route_tokens: int,
    safe_tokens: int,
    max_tokens: int | None,
    fast: Target,
    slow: Target,
    policy: RoutePolicy = RoutePolicy(),
    count_source: str = "",
) -> RouteDecision:
    """Route before failing: fast when input and output fit, a clamp when only the input fits, else slow.

    The output floor applies even when ``max_tokens`` is smaller: it is the margin that absorbs count
    error and keeps a turn from landing on fast with no room to answer.

    ``route_tokens`` is the count used to choose a backend (an under-estimate at worst: a borderline
    turn stays on fast and the reactive path catches it); ``safe_tokens`` is used to clamp the output
    budget (an over-estimate at worst). Raises :class:`ContextOverflowError` when not even slow holds it.
    """
    base = RouteDecision(fast.name, "fast", "fits", route_tokens, fast.window, max_tokens, count_source)
    if fast.window is None:
        return base
    if route_tokens + policy.output_floor > fast.window:
        return _to_slow(base, fast, slow, policy, safe_tokens)
    if max_tokens is not None and safe_tokens + max_tokens > fast.window:
        room = fast.window - safe_tokens
        if room >= policy.min_output:
            return replace(base, reason="clamped", max_tokens=room)
        return _to_slow(base, fast, slow, policy, safe_tokens)
    return base


def _to_slow(base: RouteDecision, fast: Target, slow: Target, policy: RoutePolicy, safe_tokens: int) -> RouteDecision:
    if not slow.usable:
        return replace(base, note=f"not rerouted to {slow.name!r}: {slow.why_unusable}")
    return escalate(fast, slow, route_tokens=base.estimated_input_tokens, safe_tokens=safe_tokens,
                    max_tokens=base.max_tokens, policy=policy, reason="proactive", count_source=base.count_source)


def escalate(fast: Target, slow: Target, *, route_tokens: int, safe_tokens: int, max_tokens: int | None,
             policy: RoutePolicy, reason: Reason, count_source: str = "") -> RouteDecision:
    """The move to slow: raises :class:`ContextOverflowError` when slow cannot hold the input plus the
    floor, else a decision whose budget fits slow's window (``max_tokens`` is the caller's budget)."""
    check_fits_slow(route_tokens, fast, slow, policy, max_tokens)
    budget = slow_budget(max_tokens, safe_tokens, route_tokens, slow.window)
    return RouteDecision(slow.name, "slow", reason, route_tokens, slow.window, budget, count_source)


def slow_target(name: str, window: int | None, *, is_cloud: bool, in_catalog: bool, model: str = "") -> Target:
    """The slow backend as routing sees it. The catalog rule: a cloud model litellm's catalog does not
    know cannot be routed to (litellm could not address it), so requests stay where they are."""
    if is_cloud and not in_catalog:
        return Target(name, window, usable=False, why_unusable=f"cloud model {model or name!r} is not in litellm's catalog")
    return Target(name, window)


def no_slow_target() -> Target:
    """The stand-in when a Session has no slow backend."""
    return Target("(none)", None, usable=False, why_unusable="no slow backend configured")


def as_sent(target: Target, role: Role, *, input_tokens: int, max_tokens: int | None,
            count_source: str = "") -> RouteDecision:
    """The decision describing a request another framework already sent to ``target``."""
    return RouteDecision(target.name, role, "observed", input_tokens, target.window, max_tokens, count_source)


def is_escalation(previous_role: Role | None, decision: RouteDecision) -> bool:
    """The move to slow: a size-routed slow request after fast (or first) ones."""
    return decision.role == "slow" and decision.reason in ("proactive", "reactive_escalate") and previous_role != "slow"


def check_fits_slow(route_tokens: int, fast: Target, slow: Target, policy: RoutePolicy, max_tokens: int | None) -> None:
    """Raise :class:`ContextOverflowError` when the slow backend cannot hold the input plus the floor."""
    if slow.window is not None and route_tokens + policy.output_floor > slow.window:
        raise ContextOverflowError(
            f"request of about {route_tokens} input tokens (+{policy.output_floor} output floor) fits neither "
            f"{fast.name!r} (window {fast.window}) nor {slow.name!r} (window {slow.window}); nothing was sent",
            input_tokens=route_tokens, windows={fast.name: fast.window, slow.name: slow.window},
            max_tokens=max_tokens,
        )


def slow_budget(max_tokens: int | None, safe_tokens: int, route_tokens: int, window: int | None) -> int | None:
    """``max_tokens`` clamped to what the slow window holds after the (safe) input count."""
    if max_tokens is None or window is None or safe_tokens + max_tokens <= window:
        return max_tokens
    room = window - safe_tokens
    return room if room >= 1 else max(1, window - route_tokens)


@dataclass(frozen=True)
class Recovery:
    """What to do after an overflow: "clamp" (same backend, new ``max_tokens``), "escalate", or "give_up"."""

    action: Literal["clamp", "escalate", "give_up"]
    max_tokens: int | None = None
    corrected_window: int | None = None
    prompt_tokens: int | None = None
    why: str = ""


def plan_recovery(
    overflow: Overflow,
    *,
    role: Literal["fast", "slow"],
    exact_prompt_tokens: int | None,
    requested_max_tokens: int | None,
    known_window: int | None,
    already_clamped: bool,
    slow_usable: bool,
    policy: RoutePolicy = RoutePolicy(),
    safe_prompt_tokens: int | None = None,
) -> Recovery:
    """Clamp and retry once when the real prompt leaves ``min_output``; otherwise escalate (or give up).

    The real prompt comes from an exact count, or from the server's message when it states the real
    length, or else from our own over-estimate (``safe_prompt_tokens``); the "at least" wording's
    threshold is never used as a prompt length.
    """
    window = overflow.max_context or known_window
    corrected = overflow.max_context if overflow.max_context and overflow.max_context != known_window else None
    prompt = exact_prompt_tokens if exact_prompt_tokens is not None else _stated_prompt(overflow)
    prompt = prompt if prompt is not None else safe_prompt_tokens
    floor = overflow.prompt_tokens if overflow.prompt_is_lower_bound and exact_prompt_tokens is None else None
    if floor is not None and prompt is not None and window is not None and floor > window:
        prompt = max(prompt, floor)  # our count is below the server's "at least": the prompt alone is over the window
    room = None if prompt is None or window is None else window - prompt
    if room is not None and room >= policy.min_output and not already_clamped:
        budget = room if requested_max_tokens is None else min(room, requested_max_tokens)
        if requested_max_tokens is None or budget < requested_max_tokens:  # the same budget would fail again
            return Recovery("clamp", budget, corrected, prompt, f"{room} tokens of output fit")
    if role == "fast" and slow_usable:
        why = "no exact prompt count" if prompt is None else f"only {room} tokens of output fit"
        return Recovery("escalate", None, corrected, prompt, why)
    return Recovery("give_up", None, corrected, prompt, "no larger backend to take the request")


def after_recovery(decision: RouteDecision, plan: Recovery, *, fast: Target, slow: Target, policy: RoutePolicy,
                   requested_max_tokens: int | None, safe_tokens: int) -> RouteDecision:
    """The decision for the try after ``plan`` (a "clamp" or an "escalate"; "give_up" has none).

    A clamp keeps the backend with the plan's budget; an escalation is :func:`escalate` with the
    caller's own budget, counted from the best prompt figure the plan found.
    """
    estimate = plan.prompt_tokens if plan.prompt_tokens is not None else decision.estimated_input_tokens
    if plan.action == "clamp":
        return replace(decision, reason="reactive_clamp", max_tokens=plan.max_tokens, estimated_input_tokens=estimate)
    if plan.action == "escalate":
        return escalate(fast, slow, route_tokens=estimate, safe_tokens=max(safe_tokens, estimate),
                        max_tokens=requested_max_tokens, policy=policy, reason="reactive_escalate",
                        count_source=decision.count_source)
    raise ValueError(f"a {plan.action!r} recovery has no next decision")


def failover(decision: RouteDecision, *, fast: Target, slow: Target, policy: RoutePolicy, route_tokens: int,
             safe_tokens: int, max_tokens: int | None) -> RouteDecision | None:
    """Where a request goes when its backend is down (unreachable, 502/503/504 after retries), or None.

    Fast down: slow, when it is usable and holds the request. Slow down: fast, when it is usable and the (safe) input
    leaves room for the caller's budget, or ``min_output`` of it (the budget is clamped to the room):
    the output floor's margin is waived, since the alternative is losing the turn. The decision's
    reason is ``"failover"``.
    """
    if decision.role == "fast":
        if not slow.usable:
            return None
        try:
            return escalate(fast, slow, route_tokens=route_tokens, safe_tokens=safe_tokens, max_tokens=max_tokens,
                            policy=policy, reason="failover", count_source=decision.count_source)
        except ContextOverflowError:
            return None
    if not fast.usable or fast.window is None:
        return None
    room = fast.window - safe_tokens
    if room < (policy.min_output if max_tokens is None else min(policy.min_output, max_tokens)):
        return None
    budget = None if max_tokens is None else min(max_tokens, room)
    return RouteDecision(fast.name, "fast", "failover", route_tokens, fast.window, budget, decision.count_source)


def interval_decides(
    low: int,
    high: int,
    *,
    max_tokens: int | None,
    fast: Target,
    slow: Target,
    policy: RoutePolicy = RoutePolicy(),
    warm_threshold: float | None = None,
) -> bool:
    """True when every count in ``[low, high]`` leads to the same decisions, so an estimate may decide.

    The decisions that depend on the count, and their boundaries (``W`` the fast window, ``S`` the
    slow one): the route (slow above ``W - output_floor``); the fast clamp (any count with
    ``count + max_tokens > W``: the clamped budget is ``W - count`` itself); on slow, the refusal
    (above ``S - output_floor``) and the slow clamp (``count + max_tokens > S``); and warm-ahead
    (``warm_threshold * W``, the fraction in :class:`~agentkv.warm.WarmAheadPolicy`; None when no
    warm can fire). Only the count figures the decisions carry (``estimated_input_tokens``) differ
    between an estimate that decides and the exact count.
    """
    if low > high:
        raise ValueError(f"empty interval [{low}, {high}]")
    window = fast.window
    if window is None:
        return True
    if warm_threshold is not None and low < warm_threshold * window <= high:
        return False
    boundary = window - policy.output_floor
    if low <= boundary < high:
        return False
    if high <= boundary:
        return max_tokens is None or high + max_tokens <= window
    return _slow_side_decides(high, max_tokens, slow, policy)


def _slow_side_decides(high: int, max_tokens: int | None, slow: Target, policy: RoutePolicy) -> bool:
    """Above the route boundary: no slow refusal and no slow clamp anywhere up to ``high``."""
    if not slow.usable or slow.window is None:
        return True
    if high + policy.output_floor > slow.window:
        return False  # a refusal (or a crossing into one) is reported with the exact count
    return max_tokens is None or high + max_tokens <= slow.window


def _stated_prompt(overflow: Overflow) -> int | None:
    return None if overflow.prompt_is_lower_bound else overflow.prompt_tokens
