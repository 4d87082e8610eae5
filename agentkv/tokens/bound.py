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
    bound.learn(estimate, exact, backend="fast", origin="usage")  # widens when exact is outside

The high side learns a ratio, not a distance: it scales the estimate's proportional part (the template
slack stays as it is), so a ratio seen on a short turn holds for a long one. Each side's factor is bounded
(:data:`MAX_WIDENING`): a backend that needs more is never trusted to an estimate again
(:attr:`EstimateBound.exhausted`), so its every decision is taken on the exact count.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace

from agentkv.events import emit
from agentkv.tokens.payload import TokenCount

__all__ = ["EstimateBound", "HEADROOM", "MAX_WIDENING", "informative", "shared_bound"]

# The widened interval holds the violating count's ratio with 10% to spare (a turn denser in tokens than the one seen).
HEADROOM = 1.1
# Past a 4x widening an estimate says too little to decide anything: the counter asks the exact source.
MAX_WIDENING = 4.0


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
        self.known = False
        self.exhausted = False
        self.violations = 0
        self.observations = 0
        # the byte ceiling (agentkv.tokens.ceiling) while the ratio is unknown: checked against exact counts
        self.ceilings_checked = 0
        self.ceiling_broken = False

    @property
    def trusts_ceiling(self) -> bool:
        """Whether a payload's byte ceiling may stand for its count: at least one exact count of this backend has
        been checked against its ceiling, and none has exceeded one (its template frames within the ceiling's
        allowance)."""
        return self.ceilings_checked > 0 and not self.ceiling_broken

    def check_ceiling(self, ceiling: int | None, exact: int, *, backend: str = "", origin: str = "tokenize") -> bool:
        """Check an exact count against its payload's byte ceiling (None: the payload has none); an exact count
        above it means this backend's template spends more than the ceiling allows, and the ceiling is never
        trusted again (a ``count_ceiling_exceeded`` warning). Returns whether the ceiling held."""
        if ceiling is None:
            return True
        with self._lock:
            self.ceilings_checked += 1
            held = exact <= ceiling
            self.ceiling_broken = self.ceiling_broken or not held
        if not held:
            emit("count_ceiling_exceeded", level="warning", backend=backend, origin=origin, ceiling=ceiling,
                 exact=exact)
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

    def learn(self, estimate: TokenCount, exact: int, *, backend: str = "", origin: str = "tokenize") -> bool:
        """Teach the bound an exact count of the payload ``estimate`` (already :meth:`apply`-ed) estimated.

        Above the interval, or above the estimate's safe figure on an :func:`informative` estimate (a ratio past
        the 15% margin that the template slack hid), ``high_factor`` becomes the ratio seen (``exact / total``)
        with :data:`HEADROOM`: on top of the estimate's own 15% margin, a later turn with up to 26% more tokens
        per estimated token still falls inside. Below the interval, ``low_factor`` grows to hold it with the
        same headroom. The ratio becomes :attr:`known` with an informative estimate or a count outside the
        interval (a short request inside the slack says nothing about it). Logs ``count_bound_exceeded``
        (outside the interval) or ``count_bound_learned`` and returns True when the bound widened. ``origin``:
        where the exact count came from ("tokenize", "recovery" or "usage"). An exact ``estimate`` teaches
        nothing."""
        if estimate.exact:
            return False
        low, high = estimate.interval
        telling = informative(estimate)
        with self._lock:
            self.observations += 1
            outside = not low <= exact <= high
            self.known = self.known or telling or outside
            if exact > high or (telling and exact > estimate.safe):
                wanted = exact / max(estimate.total, 1) * HEADROOM  # past the safe figure: > 1.15 * high_factor
                self.high_factor = max(self.high_factor, min(wanted, self._max))
            elif exact < low:
                wanted = self.low_factor * max(low, 1) / max(exact, 1) * HEADROOM
                self.low_factor = max(self.low_factor, min(wanted, self._max))
            else:
                return False
            self.violations += int(outside)
            self.exhausted = self.exhausted or wanted > self._max
        emit("count_bound_exceeded" if outside else "count_bound_learned", level="warning" if outside else "info",
             backend=backend, source=estimate.source, origin=origin, estimate=estimate.total, low=low, high=high,
             exact=exact, widened_by=round(self.factor, 3), high_factor=round(self.high_factor, 3),
             low_factor=round(self.low_factor, 3), exhausted=self.exhausted)
        return True


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
