"""Process-wide default instances, created on first use: the one mechanism for process-wide state.

``process_default(factory)`` gives a getter for one instance; ``shared(key, factory)`` one instance
per key (Sessions with equal warm-ahead policies share one cooldown map). Both are thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, TypeVar

T = TypeVar("T")

_INSTANCES: dict[Hashable, Any] = {}
_LOCK = threading.RLock()  # a factory may ask for another shared instance


def shared(key: Hashable, factory: Callable[[], T]) -> T:
    """The process's instance for ``key``, built by ``factory()`` the first time it is asked for."""
    with _LOCK:
        if key not in _INSTANCES:
            _INSTANCES[key] = factory()
        return _INSTANCES[key]  # type: ignore[no-any-return]


def process_default(factory: Callable[[], T], doc: str) -> Callable[[], T]:
    """A getter that builds ``factory()`` once per process and returns it thereafter."""
    key = ("process_default", factory)

    def get() -> T:
        return shared(key, factory)

    get.__doc__ = doc
    return get
