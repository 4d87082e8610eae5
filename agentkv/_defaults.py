"""Process-wide default instances, created on first use."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def process_default(factory: Callable[[], T], doc: str) -> Callable[[], T]:
    """A getter that builds ``factory()`` once per process, thread-safely, and returns it thereafter."""
    lock = threading.Lock()
    made: list[T] = []

    def get() -> T:
        with lock:
            if not made:
                made.append(factory())
            return made[0]

    get.__doc__ = doc
    return get
