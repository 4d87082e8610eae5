"""The stateful warm-ahead guards: a tenant-scoped cooldown map and a process-wide in-flight bound.

A Session reaches the cooldown map only through :meth:`CooldownMap.for_tenant`, so nothing it holds
can touch another tenant's entries. Both guards are shared per process (:func:`shared_cooldowns`,
:func:`shared_in_flight`) unless a Session is handed its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from cachetools import TTLCache

from agentkv._defaults import shared


class CooldownMap:
    """At most one warm per (tenant, session) per ``ttl_s``, in a bounded, locked ``TTLCache``.

    Many Sessions share one map (:func:`shared_cooldowns`). It offers no way to list keys; a Session
    reaches it only through :meth:`for_tenant`, which can touch its own tenant's entries and no other.
    """

    def __init__(self, maxsize: int = 256, ttl_s: float = 300.0, *, timer: Callable[[], float] = time.monotonic) -> None:
        self._entries: TTLCache[tuple[str, str], float] = TTLCache(maxsize, ttl_s, timer=timer)
        self._lock = threading.Lock()
        self._timer = timer

    def for_tenant(self, tenant: str | None) -> "TenantCooldowns":
        """The view of this map that one tenant's sessions use."""
        return TenantCooldowns(self, tenant or "")

    def size(self) -> int:
        """How many entries are held (never which)."""
        with self._lock:
            self._entries.expire()
            return len(self._entries)

    def _claim(self, key: tuple[str, str]) -> bool:
        with self._lock:
            if key in self._entries:
                return False
            self._entries[key] = self._timer()
            return True

    def _active(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._entries

    def _reset(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._entries.pop(key, None)


@dataclass(frozen=True)
class TenantCooldowns:
    """One tenant's handle on a :class:`CooldownMap`: every key it forms carries that tenant."""

    _map: CooldownMap
    tenant: str

    def claim(self, session_id: str) -> bool:
        """Start a cooldown for ``session_id`` unless one is running; True when this call started it."""
        return self._map._claim((self.tenant, session_id))

    def active(self, session_id: str) -> bool:
        """True while ``session_id`` is cooling down."""
        return self._map._active((self.tenant, session_id))

    def reset(self, session_id: str) -> None:
        """End ``session_id``'s cooldown early (this tenant's sessions only)."""
        self._map._reset((self.tenant, session_id))


class InFlightLimit:
    """A process-wide bound on warms in flight; past it, warms are skipped, never queued."""

    def __init__(self, limit: int = 4) -> None:
        self._slots = threading.BoundedSemaphore(limit)

    def try_acquire(self) -> bool:
        return self._slots.acquire(blocking=False)

    def release(self) -> None:
        self._slots.release()


def shared_cooldowns(maxsize: int = 256, ttl_s: float = 300.0) -> CooldownMap:
    """The process-wide cooldown map for these settings: Sessions with equal policies share one."""
    return shared(("cooldowns", maxsize, ttl_s), lambda: CooldownMap(maxsize, ttl_s))


def shared_in_flight(limit: int = 4) -> InFlightLimit:
    """The process-wide in-flight bound for this limit."""
    return shared(("in_flight", limit), lambda: InFlightLimit(limit))
