"""How far an estimate's interval is trusted, widened each time an exact count falls outside it.

The tiktoken estimate's interval (:func:`agentkv.tokens.sources.estimate_interval`) assumes the backend's
tokenizer counts within 15% of cl100k and its template's framing within a few tokens a message. A backend
that breaks the assumption shows it whenever the exact count is asked (near a boundary) and lands outside
the interval. :class:`EstimateBound` then widens every later interval by the factor that would have held
that count, with headroom, so the same conversation shape asks for the exact count from then on:

    bound = shared_bound("http://gpu-1:8000|qwen")  # one per server and model per process
    low, high = bound.widened(low, high)
    bound.observe(low, high, exact)                  # after an exact count: widens when exact is outside

The factor is bounded (:data:`MAX_WIDENING`): a backend that needs more is never trusted to an
estimate again (:attr:`EstimateBound.exhausted`), so its every decision is taken on the exact count.
"""

from __future__ import annotations

import math
import threading

__all__ = ["EstimateBound", "HEADROOM", "MAX_WIDENING", "shared_bound"]

# The widened interval holds the violating count with 10% to spare (a slightly longer turn of the same shape).
HEADROOM = 1.1
# Past a 4x widening an estimate says too little to decide anything: the counter asks the exact source.
MAX_WIDENING = 4.0


class EstimateBound:
    """A widening factor for estimate intervals, learned from exact counts that fell outside them.

    ``factor`` starts at 1 (the documented bound) and only grows; thread-safe."""

    def __init__(self, max_widening: float = MAX_WIDENING) -> None:
        self._lock = threading.Lock()
        self._max = max_widening
        self.factor = 1.0
        self.exhausted = False
        self.violations = 0

    def widened(self, low: int, high: int) -> tuple[int, int]:
        """``[low, high]`` widened by the factor: ``low / factor``, ``high * factor``."""
        factor = self.factor
        if factor == 1.0:
            return low, high
        return math.floor(low / factor), math.ceil(high * factor)

    def observe(self, low: int, high: int, exact: int) -> bool:
        """Widen so that ``exact`` (counted while the interval was ``[low, high]``, already widened) would have
        fallen inside, with :data:`HEADROOM`; True when it was outside."""
        if low <= exact <= high:
            return False
        need = exact / max(high, 1) if exact > high else max(low, 1) / max(exact, 1)
        with self._lock:
            self.violations += 1
            wanted = self.factor * need * HEADROOM
            self.exhausted = self.exhausted or wanted > self._max
            self.factor = max(self.factor, min(wanted, self._max))
        return True


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
