"""A clock for tests: time that moves only when told.

    clock = FakeClock()
    WarmAheadPolicy(...); CooldownMap(clock=clock)     # anything that takes a timer=/clock=
    clock.advance(300)                                  # five minutes, in a microsecond
"""

from __future__ import annotations

import threading

__all__ = ["FakeClock"]


class FakeClock:
    """A monotonic clock that moves only when told: pass it as ``timer=``/``clock=``."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
