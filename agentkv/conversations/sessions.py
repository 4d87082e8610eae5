"""Conversations held in memory (the gateway's, and those of each :class:`~agentkv.Conversations`): one Session each,
in a bounded map (LRU, plus an idle TTL).

Memory stays bounded whatever clients send: past ``max_sessions`` the least recently used conversation is
dropped, and one idle for ``idle_s`` is dropped at the next access. A dropped conversation loses only what
its Session kept in this process (the previous turn's role and counts); its warm-ahead cooldown lives in the
shared :class:`~agentkv.state.StateStore`, so a conversation that comes back is not warmed twice.

    sessions = SessionMap(lambda key: Session(fast, slow, tenant=key[0], session_id=key[1]), max_sessions=10_000)
    session = sessions.get(("acme", "h:chat-42"))
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from agentkv.errors import ConfigurationError

__all__ = ["SessionMap"]

K = TypeVar("K")
V = TypeVar("V")


class SessionMap(Generic[K, V]):
    """A bounded map of values built on first use by ``factory(key)``, dropped least recently used first and
    after ``idle_s`` without use (``clock`` is injectable). ``on_drop`` is handed each value dropped."""

    def __init__(self, factory: Callable[[K], V], *, max_sessions: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic, on_drop: Callable[[V], None] | None = None) -> None:
        if max_sessions < 1 or not idle_s > 0:
            raise ConfigurationError(f"SessionMap needs max_sessions >= 1 and idle_s > 0, got {max_sessions}, {idle_s}")
        self._factory, self._clock, self._on_drop = factory, clock, on_drop
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[K]:
        """The keys held, least recently used first."""
        return list(self._entries)

    def values(self) -> list[V]:
        """The values held, least recently used first."""
        return [value for _, value in self._entries.values()]

    def clear(self) -> list[V]:
        """Forget every entry (``on_drop`` is not called) and return the values, least recently used first."""
        values = self.values()
        self._entries.clear()
        return values

    def get(self, key: K) -> V:
        """The value for ``key``, built when absent or expired; it becomes the most recently used."""
        now = self._clock()
        self._expire(now)
        entry = self._entries.pop(key, None)
        value = entry[1] if entry is not None else self._factory(key)
        self._entries[key] = (now, value)
        while len(self._entries) > self.max_sessions:
            self._drop(next(iter(self._entries)))
        return value

    def _expire(self, now: float) -> None:
        """Drop the idle entries: they sit at the front, since each use moves its entry to the back."""
        while self._entries:
            key, (used, _) = next(iter(self._entries.items()))
            if now - used < self.idle_s:
                return
            self._drop(key)

    def _drop(self, key: K) -> None:
        _, value = self._entries.pop(key)
        if self._on_drop is not None:
            self._on_drop(value)
