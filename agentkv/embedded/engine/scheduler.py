"""Taking turns on one model: a first-come-first-served lock, and what a finished request reports.

:class:`FairLock` hands the model to waiting threads in arrival order (``threading.Lock`` makes no such
promise), so a request that has waited longest always runs next and a stream of decode steps from one request
cannot starve another. :class:`RequestTrace` is the timing record a request leaves for the metrics.

Usage::

    lock = FairLock()
    with lock:
        ...                                  # one prefill or one decode step
    lock.acquire(cancel=abort_event)         # False if the event is set before the turn comes
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class Aborted(Exception):
    """The request was aborted (its client went away) before it got a turn."""


class FairLock:
    """A mutex granted in the order it was asked for, handed directly from each holder to the next waiter.

    Each waiter sleeps on its own event (no thundering herd when hundreds wait) and keeps its place in the queue
    while it polls for cancellation.
    """

    POLL_S = 0.05

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Event] = deque()

    def acquire(self, blocking: bool = True, timeout: float | None = None,
                cancel: threading.Event | None = None) -> bool:
        """Wait for this caller's turn; False if ``timeout`` (seconds) passed or ``cancel`` was set first."""
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return True
            if not blocking:
                return False
            turn = threading.Event()
            self._waiters.append(turn)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self.POLL_S if deadline is None else min(self.POLL_S, max(0.0, deadline - time.monotonic()))
            if turn.wait(wait):
                return True
            expired = deadline is not None and time.monotonic() >= deadline
            if expired or (cancel is not None and cancel.is_set()):
                with self._mutex:
                    if turn.is_set():  # handed over just now: it is ours
                        return True
                    self._waiters.remove(turn)
                return False

    def release(self) -> None:
        """Hand the lock to the longest waiter, or free it."""
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._held = False

    @property
    def waiting(self) -> int:
        """Callers queued for the lock."""
        with self._mutex:
            return len(self._waiters)

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
