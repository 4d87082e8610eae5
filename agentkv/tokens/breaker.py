"""A circuit breaker per count source: a source that timed out or failed is not waited on again.

A timeout, a connection failure or a 5xx opens the breaker for a back-off period (doubling with each
consecutive failure, up to ``max_backoff_s``); while open, the source is not asked and the next source
in the ladder answers. After the back-off, one request is let through as a probe: its success closes
the breaker, its failure opens it again for longer. Breakers are per (process, backend):
:func:`shared_breaker` returns the one for a ``/tokenize`` URL.

    breaker = shared_breaker("http://10.0.0.5:8000/tokenize")
    if breaker.allow():
        ...  # ask; then breaker.succeeded() or breaker.failed()
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from agentkv._support.defaults import shared

__all__ = ["CircuitBreaker", "shared_breaker"]


class CircuitBreaker:
    """Closed, open until a deadline, or probing (one request in flight after the back-off)."""

    def __init__(self, *, backoff_s: float = 10.0, max_backoff_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")
        self._backoff_s, self._max_backoff_s, self._clock = backoff_s, max_backoff_s, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        """True while requests are refused (open, or a probe is in flight)."""
        with self._lock:
            return self._open_until is not None and (self._probing or self._clock() < self._open_until)

    def allow(self) -> bool:
        """Whether to ask the source now; after the back-off, the first caller gets to probe."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        """The source answered: close."""
        with self._lock:
            self._failures, self._open_until, self._probing = 0, None, False

    def failed(self) -> None:
        """The source timed out or failed: open for the next back-off."""
        with self._lock:
            self._failures += 1
            delay = min(self._max_backoff_s, self._backoff_s * 2 ** (self._failures - 1))
            self._open_until, self._probing = self._clock() + delay, False


def shared_breaker(url: str) -> CircuitBreaker:
    """The process's breaker for the source at ``url``."""
    return shared(("count_source_breaker", url), CircuitBreaker)
