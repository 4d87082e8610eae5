"""Taking turns on one model: a first-come-first-served lock, and what a finished request reports.

:class:`FairLock` hands the model to waiting threads in arrival order (``threading.Lock`` makes no such
promise), so a request that has waited longest always runs next and a stream of decode steps from one request
cannot starve another. :class:`RequestTrace` is the timing record a request leaves for the metrics.

Usage::

    lock = FairLock()
    with lock:
        ...                                  # one prefill or one decode step
    lock.acquire(timeout=0.05)               # False on timeout (lets a waiter check for an abort)
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class Aborted(Exception):
    """The request was aborted (its client went away) before it got a turn."""


class FairLock:
    """A mutex granted in the order it was asked for."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[object] = deque()
        self._held = False

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Wait for this caller's turn; False if ``timeout`` (seconds) passed first."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            granted = self._cond.wait_for(lambda: not self._held and self._queue[0] is ticket,
                                          None if blocking and timeout is None else (timeout or 0.0))
            if not granted:
                self._queue.remove(ticket)
                self._cond.notify_all()
                return False
            self._queue.popleft()
            self._held = True
            return True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@dataclass
class RequestTrace:
    """When one sequence arrived, got its first turn, produced each token and ended (perf_counter seconds)."""

    prompt_tokens: int
    max_tokens: int
    n: int = 1
    arrival: float = 0.0
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float = 0.0
    finish_reason: str = "abort"
    cached_tokens: int = 0
    prefill_tokens: int = 0

    @property
    def generation_tokens(self) -> int:
        return len(self.token_times)
