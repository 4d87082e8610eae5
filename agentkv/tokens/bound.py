"""How far an estimate's interval is trusted: learned per server and model from every exact count seen.

The tiktoken estimate's interval (:func:`agentkv.tokens.sources.estimate_interval`) assumes the backend's
tokenizer counts within 15% of cl100k and its template's framing within a few tokens a message. Nothing
makes a backend keep that promise (a BPE trained on code counts English at twice cl100k's rate), so an
:class:`EstimateBound` learns how far off its backend is from the exact counts it is shown: a ``/tokenize``
answer asked near a boundary, the count taken while recovering from an overflow, and every response's
``usage.prompt_tokens`` (the server's own count of what it was sent). An exact count above the interval
(or, on a long enough request, above the estimate's 15% margin) widens the high side of every later
interval to the ratio seen, with headroom; one below widens the low side. A backend that has shown no
telling exact count yet (one outside the interval, or of a request long enough that the template slack
does not hide the ratio) has an unknown ratio (:attr:`EstimateBound.known` is False): its counter asks the
exact source for every decision until it has.

    bound = shared_bound("http://gpu-1:8000|qwen")  # one per server and model per process
    estimate = bound.apply(estimate)                 # interval and safe figure widened by what was learned
    bound.learn(estimate, exact, backend="fast", origin="tokenize")  # widens when exact is outside

Who may widen it: an exact source (``origin`` "tokenize": the server's ``/tokenize`` or a declared template;
"recovery": the count taken while recovering from an overflow, from the same sources) widens it at once. An
answer's ``usage.prompt_tokens`` (origin "usage") is the server's say-so, and one broken or hostile answer must not
move every Session's routing: it is a claim. No single claim widens the bound; :data:`QUORUM_ANSWERS` claims from
:data:`QUORUM_SESSIONS` distinct Sessions do, to the least widening they all ask for (:func:`agreed`). Until then
the ratio is in doubt (:attr:`EstimateBound.known` is False), so a counter with an exact source asks it, and its
count settles the doubt. A count that is not an integer from 0 to :data:`MAX_COUNT` teaches nothing.

The high side learns a ratio, not a distance: it scales the estimate's proportional part (the template
slack stays as it is), so a ratio seen on a short turn holds for a long one. Each side's factor is bounded
(:data:`MAX_WIDENING`): a backend that needs more is never trusted to an estimate again
(:attr:`EstimateBound.exhausted`), so its every decision is taken on the exact count.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import replace
from typing import Iterable

from agentkv.events import emit
from agentkv.tokens.payload import TokenCount

__all__ = ["EXACT_ORIGINS", "EstimateBound", "HEADROOM", "MAX_COUNT", "MAX_WIDENING", "QUORUM_ANSWERS",
           "QUORUM_SESSIONS", "agreed", "informative", "shared_bound"]

# The widened interval holds the violating count's ratio with 10% to spare (a turn denser in tokens than the one seen).
HEADROOM = 1.1
# Past a 4x widening an estimate says too little to decide anything: the counter asks the exact source.
MAX_WIDENING = 4.0
# Where an exact count comes from a source of our own asking, which widens at once; any other origin is a claim.
EXACT_ORIGINS = frozenset({"tokenize", "recovery"})
# A claim widens only with this many agreeing, from this many distinct Sessions.
QUORUM_ANSWERS = 3
QUORUM_SESSIONS = 2
# No count past this is believed (the bound agentkv.wire.usage reads answers' usage against).
MAX_COUNT = 2 ** 31
_CLAIMS_KEPT = 32  # the latest claims per bound, waiting for agreement


class EstimateBound:
    """Widening factors for estimate intervals, learned from exact counts that fell outside them.

    ``high_factor`` scales an estimate's proportional part (its safe figure, ``total * 1.15`` for tiktoken: the
    high end is that plus the template slack), ``low_factor`` divides the low end; both start at 1 (the
    documented bound) and only grow. ``known``: an exact count was seen, so the backend's ratio to the estimate
    has been checked at least once. Thread-safe."""

    def __init__(self, max_widening: float = MAX_WIDENING) -> None:
        self._lock = threading.Lock()
        self._max = max_widening
        self.low_factor = 1.0
        self.high_factor = 1.0
        self._known = False
        self._doubted = False  # a claim wants a widening no exact source or quorum has confirmed yet
        self._claims: deque[tuple[str, float, str]] = deque(maxlen=_CLAIMS_KEPT)  # (side, factor wanted, session)
        self._ceiling_claims: deque[tuple[float, str]] = deque(maxlen=_CLAIMS_KEPT)  # answers past their ceiling
        self.exhausted = False
        self.violations = 0
        self.observations = 0
        # the byte ceiling (agentkv.tokens.ceiling) while the ratio is unknown: checked against exact counts
        self.ceilings_checked = 0
        self.ceiling_broken = False

    @property
    def known(self) -> bool:
        """Whether the backend's ratio to the estimate is known: an exact count told it, and no claim since
        (an answer's usage outside what the bound holds) is waiting on confirmation."""
        return self._known and not self._doubted

    @property
    def trusts_ceiling(self) -> bool:
        """Whether a payload's byte ceiling may stand for its count: at least one exact count of this backend has
        been checked against its ceiling, and none has exceeded one (its template frames within the ceiling's
        allowance)."""
        return self.ceilings_checked > 0 and not self.ceiling_broken

    def check_ceiling(self, ceiling: int | None, exact: int, *, backend: str = "", origin: str = "tokenize",
                      session: str | None = None) -> bool:
        """Check an exact count against its payload's byte ceiling (None: the payload has none); an exact count
        above it means this backend's template spends more than the ceiling allows, and the ceiling is never
        trusted again (a ``count_ceiling_exceeded`` warning). From an answer's usage (an ``origin`` outside
        :data:`EXACT_ORIGINS`) that is a claim, as for the widening: the ceiling breaks once :data:`QUORUM_ANSWERS`
        such claims from :data:`QUORUM_SESSIONS` Sessions were seen. Returns whether the ceiling held."""
        if ceiling is None:
            return True
        with self._lock:
            self.ceilings_checked += 1
            held = exact <= ceiling
            if not held and origin not in EXACT_ORIGINS:
                self._ceiling_claims.append((1.0, session or ""))
            broken = not held and (origin in EXACT_ORIGINS or agreed(self._ceiling_claims) is not None)
            self.ceiling_broken = self.ceiling_broken or broken
        if not held:
            emit("count_ceiling_exceeded", level="warning", backend=backend, origin=origin, ceiling=ceiling,
                 exact=exact, broken=broken)
        return held

    @property
    def factor(self) -> float:
        """The larger of the two factors (1: the documented bound has held so far)."""
        return max(self.low_factor, self.high_factor)

    def apply(self, count: TokenCount) -> TokenCount:
        """``count`` widened by what was learned: its safe figure times ``high_factor`` (the high end moves with
        it, keeping its slack), its low end divided by ``low_factor``; an exact count as it is."""
        low_factor, high_factor = self.low_factor, self.high_factor
        if count.exact or (low_factor == 1.0 and high_factor == 1.0):
            return count
        low, high = count.interval
        safe = count.safe if high_factor == 1.0 else math.ceil(count.safe * high_factor)
        return replace(count, safe=safe, low=low if low_factor == 1.0 else math.floor(low / low_factor),
                       high=high + safe - count.safe)

    def learn(self, estimate: TokenCount, exact: int, *, backend: str = "", origin: str = "tokenize",
              session: str | None = None) -> bool:
        """Teach the bound an exact count of the payload ``estimate`` (already :meth:`apply`-ed) estimated.

        Above the interval, or above the estimate's safe figure on an :func:`informative` estimate (a ratio past
        the 15% margin that the template slack hid), the count wants ``high_factor`` to be the ratio seen
        (``exact / total``) with :data:`HEADROOM`: on top of the estimate's own 15% margin, a later turn with up to
        26% more tokens per estimated token still falls inside. Below the interval, it wants ``low_factor`` grown to
        hold it with the same headroom. From an exact source (:data:`EXACT_ORIGINS`) that widening is made; from
        an answer's usage (``session``: the Session it answered) it is a claim, made only once :func:`agreed` by
        enough Sessions, and in doubt until then. The ratio becomes :attr:`known` with an informative estimate or
        a count outside the interval (a short request inside the slack says nothing about it). Logs
        ``count_bound_exceeded`` (outside the interval), ``count_bound_learned`` or ``count_bound_claimed`` (a claim
        inside it), and returns True when the bound widened. An exact ``estimate``, or an ``exact`` that is not an
        integer from 0 to :data:`MAX_COUNT`, teaches nothing."""
        if estimate.exact or isinstance(exact, bool) or not isinstance(exact, int) or not 0 <= exact <= MAX_COUNT:
            return False
        low, high = estimate.interval
        telling, outside = informative(estimate), not low <= exact <= high
        trusted = origin in EXACT_ORIGINS
        with self._lock:
            self.observations += 1
            wanted = self._wanted(estimate, exact, telling)
            if wanted is None:
                self._known = self._known or telling
                self._doubted = self._doubted and not (trusted and telling)  # an exact count that tells settles it
                return False
            self.violations += int(outside)
            widened = self._widen(*wanted) if trusted else self._claim(*wanted, session or "")
        self._log(estimate, exact, backend=backend, origin=origin, outside=outside, widened=widened)
        return widened

    def _wanted(self, estimate: TokenCount, exact: int, telling: bool) -> tuple[str, float] | None:
        """The side (``"high"`` or ``"low"``) and factor ``exact`` asks for; None when the bound holds it."""
        low, high = estimate.interval
        if exact > high or (telling and exact > estimate.safe):
            return "high", exact / max(estimate.total, 1) * HEADROOM  # past the safe figure: > 1.15 * high_factor
        if exact < low:
            return "low", self.low_factor * max(low, 1) / max(exact, 1) * HEADROOM
        return None

    def _widen(self, side: str, wanted: float) -> bool:
        """Widen ``side`` to ``wanted`` (at most :data:`MAX_WIDENING`); the ratio is known and no longer in doubt."""
        if side == "high":
            self.high_factor = max(self.high_factor, min(wanted, self._max))
        else:
            self.low_factor = max(self.low_factor, min(wanted, self._max))
        self.exhausted = self.exhausted or wanted > self._max
        self._known, self._doubted = True, False
        held = self.high_factor if side == "high" else self.low_factor
        self._claims = deque((c for c in self._claims if c[0] != side or c[1] > held), maxlen=_CLAIMS_KEPT)
        return True

    def _claim(self, side: str, wanted: float, session: str) -> bool:
        """Note a claim; widen to what enough claims agree on, else leave the ratio in doubt."""
        self._claims.append((side, wanted, session))
        consensus = agreed((w, s) for c_side, w, s in self._claims if c_side == side)
        if consensus is None:
            self._doubted = True
            return False
        return self._widen(side, consensus)

    def _log(self, estimate: TokenCount, exact: int, *, backend: str, origin: str, outside: bool,
             widened: bool) -> None:
        low, high = estimate.interval
        event = "count_bound_exceeded" if outside else "count_bound_learned" if widened else "count_bound_claimed"
        emit(event, level="warning" if outside else "info", backend=backend, source=estimate.source, origin=origin,
             estimate=estimate.total, low=low, high=high, exact=exact, widened=widened,
             widened_by=round(self.factor, 3), high_factor=round(self.high_factor, 3),
             low_factor=round(self.low_factor, 3), exhausted=self.exhausted, claims=len(self._claims))


def agreed(claims: Iterable[tuple[float, str]]) -> float | None:
    """The widest factor that at least :data:`QUORUM_ANSWERS` of ``claims`` (``(factor wanted, session)``), from
    at least :data:`QUORUM_SESSIONS` distinct sessions, all ask for (the least of them); None when none is. One
    claim far past the others never pulls the agreement past what the others ask."""
    sessions: set[str] = set()
    for n, (wanted, session) in enumerate(sorted(claims, reverse=True), 1):
        sessions.add(session)
        if n >= QUORUM_ANSWERS and len(sessions) >= QUORUM_SESSIONS:
            return wanted
    return None


def informative(estimate: TokenCount) -> bool:
    """Whether an exact count of ``estimate``'s payload tells its ratio: the template slack (the high end past
    the safe figure) is at most a quarter of the estimate, so the count is mostly text, not framing."""
    return estimate.interval[1] - estimate.safe <= estimate.total / 4


_SHARED: dict[str, EstimateBound] = {}
_SHARED_LOCK = threading.Lock()


def shared_bound(key: str) -> EstimateBound:
    """The process's bound for one backend (its server root, or label, and its served model: another model
    behind the same URL has another tokenizer): every Session on it learns at once."""
    with _SHARED_LOCK:
        bound = _SHARED.get(key)
        if bound is None:
            bound = _SHARED[key] = EstimateBound()
        return bound
