"""The break-even gate: warm only when the conversation is predicted to escalate while the warm is still cached.

A warm costs one prefill of the conversation on the slow server. It pays only when an escalation reads it,
and an escalation can read it only while the slow server's prefix cache still holds it. Most conversations
never leave the fast model (their lengths are heavy-tailed), and a slow-growing one that crosses the warm
threshold may take longer to reach the route boundary than the cache keeps a block. The gate forecasts, from
the conversation's own recent turns, when it will cross the boundary, and lets a warm through only when that
moment falls inside the cache's expected lifetime.

    forecast = forecast_escalation(history, boundary_tokens=1792)   # history: [TurnSample(at_s, tokens), ...]
    decide_break_even(history, boundary_tokens=1792, lifetime_s=600.0)  # "fire", "break_even" or "no_history"

Everything here is pure: the Session keeps the last few :class:`TurnSample`s (bounded) and hands them in.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

if TYPE_CHECKING:
    from agentkv.providers.prices import Prices

__all__ = ["BreakEvenOutcome", "EscalationRate", "Forecast", "TurnSample", "decide_break_even", "forecast_escalation",
           "since_last_shrink", "warm_premium"]

BreakEvenOutcome = Literal["fire", "break_even", "no_history"]


@dataclass(frozen=True)
class TurnSample:
    """One request of a conversation: when it was made (seconds on the Session's clock) and its input tokens."""

    at_s: float
    tokens: int


@dataclass(frozen=True)
class Forecast:
    """When the conversation is predicted to cross the route boundary.

    ``turns``: requests until the first one past the boundary (0: this one already is; None: not growing);
    ``seconds``: ``turns`` times the mean time between requests (None when ``turns`` is None);
    ``tokens_per_turn`` and ``seconds_per_turn``: the mean growth and pace the forecast used.
    """

    turns: int | None
    seconds: float | None
    tokens_per_turn: float
    seconds_per_turn: float


def since_last_shrink(history: Sequence[TurnSample]) -> Sequence[TurnSample]:
    """The samples that describe the conversation now: those since it last shrank (an agent that truncates or
    compacts its history starts a new growth record). A shrink on the newest step leaves no rate since it: the
    whole window is read then (a truncation reads as not growing; a count that dips by an estimate's error
    between two turns does not veto a conversation that grew over the window)."""
    start = 0
    for i in range(1, len(history)):
        if history[i].tokens < history[i - 1].tokens:
            start = i
    return history[start:] if len(history) - start >= 2 else history


def forecast_escalation(history: Sequence[TurnSample], *, boundary_tokens: int) -> Forecast | None:
    """Extrapolate the mean growth and pace over ``history`` (oldest first; only the samples since it last
    shrank, :func:`since_last_shrink`) to the boundary; None with fewer than two samples (no rate yet)."""
    if len(history) < 2:
        return None
    history = since_last_shrink(history)
    first, last = history[0], history[-1]
    steps = len(history) - 1
    growth = (last.tokens - first.tokens) / steps
    pace = max(0.0, last.at_s - first.at_s) / steps
    remaining = boundary_tokens - last.tokens
    if remaining <= 0:
        return Forecast(0, 0.0, growth, pace)
    if growth <= 0:
        return Forecast(None, None, growth, pace)
    turns = math.ceil(remaining / growth)
    return Forecast(turns, turns * pace, growth, pace)


def decide_break_even(history: Sequence[TurnSample], *, boundary_tokens: int, lifetime_s: float,
                      min_samples: int = 2) -> BreakEvenOutcome:
    """"fire" when the forecast escalation falls within ``lifetime_s``; "break_even" (skip) when it falls later
    or the conversation is not growing; "no_history" with fewer than ``min_samples`` samples (the caller then
    keeps the seed's behaviour: the gate only refuses on evidence)."""
    if len(history) < max(2, min_samples):
        return "no_history"
    forecast = forecast_escalation(history, boundary_tokens=boundary_tokens)
    if forecast is None or forecast.seconds is None or forecast.seconds > lifetime_s:
        return "break_even"
    return "fire"


def warm_premium(prices: "Prices", *, escalation_rate: float, writes_own_cache: bool) -> float:
    """A warm's expected extra spend per dollar the escalated turn would pay for the prefix unwarmed.

    The warm pays the prefix at the cache-write price; the escalation that follows it (with probability
    ``escalation_rate``) reads it instead of paying it again, at the write price when it would have cached it
    itself (``writes_own_cache``: Anthropic's breakpoints, OpenAI's and Gemini's automatic caching; not a Gemini
    explicit cache, created only by warms) or else at the input price:
    ``(write + p·read − p·unwarmed) / (p·unwarmed)``. At Anthropic's 5-minute prices that is 0.08 at p = 1 and
    1.08 at p = 0.5; it is infinite at p = 0. A warm buys latency, never money: the premium is what it costs."""
    unwarmed = prices.cache_write if writes_own_cache else prices.input
    if escalation_rate <= 0 or unwarmed <= 0:
        return math.inf
    p = min(1.0, escalation_rate)
    return (prices.cache_write + p * prices.cache_read - p * unwarmed) / (p * unwarmed)


class EscalationRate:
    """The share of conversations that escalated after crossing the warm threshold, for one slow model in this
    process, as ``(escalated + 1) / (crossed + 2)`` (0.5 before any evidence). Crossings are counted whether or not
    a warm went out, so a gate that skips every warm keeps learning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.crossed = 0
        self.escalated = 0

    def cross(self) -> None:
        with self._lock:
            self.crossed += 1

    def escalate(self) -> None:
        with self._lock:
            self.escalated = min(self.crossed, self.escalated + 1)

    @property
    def rate(self) -> float:
        with self._lock:
            return (self.escalated + 1) / (self.crossed + 2)
