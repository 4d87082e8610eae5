"""The warm-ahead policy and its pure decision: whether a request should warm the slow model now.

The stateful guards that come after this decision are in :mod:`agentkv.state.guards`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal, Sequence

from agentkv.errors import ConfigurationError, check_positive_int
from agentkv.warm.economics import TurnSample, decide_break_even

WarmOutcome = Literal[
    "fire", "below_threshold", "disabled", "routed_slow", "unknown_model", "no_window", "cooldown", "saturated",
    "state_unavailable", "break_even", "below_cache_minimum", "cost",
]


@dataclass(frozen=True)
class WarmAheadPolicy:
    """When and how often warm-ahead fires.

        WarmAheadPolicy(threshold=0.6, cooldown_s=300, max_sessions=256, max_in_flight=4, timeout_s=30)

    ``threshold`` is a fraction of the fast window (0.6: at 0.9 the warm arrives too late);
    ``cooldown_s`` bounds warms to one per (tenant, session) per period; ``max_sessions`` bounds the
    cooldown map; ``max_in_flight`` bounds concurrent warms per process; ``timeout_s`` bounds each warm.
    ``top_up_tokens`` (event-aware mode only, a Session with a ``ledger``): once the slow server's cached
    prefix of the conversation trails the prompt by this many tokens, a top-up warm is sent inside the
    cooldown (it prefills only that tail); a resident prefix trailing by less is not warmed again.

    The break-even gate (off by default; :mod:`agentkv.warm.economics`): with ``break_even=True`` a warm
    (a re-warm or top-up too) goes out only when the conversation's growth over its last ``growth_turns``
    requests predicts it will cross the route boundary within ``cache_lifetime_s``, the time the slow server's
    prefix cache keeps a block (see docs/warm-ahead.md, "Warm economics", for how to measure it).

        WarmAheadPolicy(break_even=True, cache_lifetime_s=600, growth_turns=6)

    Cost-aware warming (off by default; a hosted slow model): with ``cost_aware=True`` a warm goes out only when its
    expected extra spend, per dollar the escalated turn would pay for the prefix unwarmed, is at most
    ``max_premium`` (:func:`agentkv.warm.economics.warm_premium`: litellm's cache prices and the share of this
    process's conversations that escalated after crossing the threshold). A warm is a purchase of latency: at
    Anthropic's prices it costs 8% more than no warm when the conversation surely escalates, and 1.25× the
    prefix when it never does (docs/hosted.md).

        WarmAheadPolicy(cost_aware=True, max_premium=0.25)
    """

    threshold: float = 0.6
    cooldown_s: float = 300.0
    max_sessions: int = 256
    max_in_flight: int = 4
    timeout_s: float = 30.0
    enabled: bool = True
    top_up_tokens: int = 1024
    break_even: bool = False
    cache_lifetime_s: float = 600.0
    growth_turns: int = 6
    cost_aware: bool = False
    max_premium: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigurationError(f"WarmAheadPolicy.threshold must be in (0, 1], got {self.threshold!r}")
        for name in ("cooldown_s", "timeout_s", "cache_lifetime_s"):
            value = getattr(self, name)  # NaN compares false with everything: it would pass ``<= 0`` unseen
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
                raise ConfigurationError(f"WarmAheadPolicy.{name} must be a positive number, got {value!r}")
        for name in ("enabled", "break_even"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"WarmAheadPolicy.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_sessions", "max_in_flight", "top_up_tokens"):
            check_positive_int("WarmAheadPolicy", name, getattr(self, name))
        if not isinstance(self.cost_aware, bool):
            raise ConfigurationError(f"WarmAheadPolicy.cost_aware must be a bool, got {self.cost_aware!r}")
        if isinstance(self.max_premium, bool) or not isinstance(self.max_premium, numbers.Real) or \
                not float(self.max_premium) >= 0:
            raise ConfigurationError(f"WarmAheadPolicy.max_premium must be a number >= 0, got {self.max_premium!r}")
        if isinstance(self.growth_turns, bool) or not isinstance(self.growth_turns, int) or self.growth_turns < 2:
            raise ConfigurationError(f"WarmAheadPolicy.growth_turns must be an int >= 2, got {self.growth_turns!r}")


@dataclass(frozen=True)
class WarmDecision:
    """Whether to warm now, and the outcome name counted in stats."""

    outcome: WarmOutcome

    @property
    def fire(self) -> bool:
        return self.outcome == "fire"


def decide_warm(
    *,
    estimated_tokens: int,
    fast_window: int | None,
    routed_role: str,
    enabled: bool,
    model_known: bool,
    policy: WarmAheadPolicy,
    history: Sequence[TurnSample] = (),
    boundary_tokens: int | None = None,
    min_cacheable: int | None = None,
    premium: float | None = None,
) -> WarmDecision:
    """The stateless part of the warm-ahead decision (cooldown and in-flight limits come after).

    ``history`` (the conversation's recent requests, oldest first, this one last) and ``boundary_tokens``
    (the count past which a request leaves fast) feed the break-even gate when ``policy.break_even``;
    ``min_cacheable``: a hosted slow model's shortest cacheable prompt (a shorter warm writes nothing);
    ``premium``: the warm's expected extra spend per escalation dollar, for ``policy.cost_aware`` (None: unknown)."""
    if fast_window is None:
        return WarmDecision("no_window")
    if estimated_tokens < policy.threshold * fast_window:
        return WarmDecision("below_threshold")
    if routed_role == "slow":
        return WarmDecision("routed_slow")  # the request itself warms the slow cache
    if not enabled or not policy.enabled:
        return WarmDecision("disabled")
    if not model_known:
        return WarmDecision("unknown_model")
    if min_cacheable is not None and estimated_tokens < min_cacheable:
        return WarmDecision("below_cache_minimum")
    if policy.cost_aware and premium is not None and premium > policy.max_premium:
        return WarmDecision("cost")
    if policy.break_even and boundary_tokens is not None and decide_break_even(
            history, boundary_tokens=boundary_tokens, lifetime_s=policy.cache_lifetime_s) == "break_even":
        return WarmDecision("break_even")
    return WarmDecision("fire")
