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

from agentkv._support.defaults import shared


class CooldownMap:
    """At most one warm per (tenant, session) per ``ttl_s``; each tenant's entries in a bounded ``TTLCache``
    of its own, all behind one lock.

    ``maxsize`` bounds each tenant's sessions separately (past it, that tenant's oldest entry is evicted, as
    :class:`~agentkv.state.redis.RedisStore` does): a tenant opening any number of sessions evicts only its
    own cooldowns, never another tenant's. ``max_tenants`` bounds how many tenants hold live entries at once;
    past it a new tenant's claim is refused (that warm is skipped) rather than evicting anyone's cooldowns.
    Many Sessions share one map (:func:`shared_cooldowns`). It offers no way to list keys; a Session
    reaches it only through :meth:`for_tenant`, which can touch its own tenant's entries and no other.
    """

    def __init__(self, maxsize: int = 256, ttl_s: float = 300.0, *, timer: Callable[[], float] = time.monotonic,
                 max_tenants: int = 1024) -> None:
        self.maxsize, self.ttl_s, self.max_tenants = maxsize, ttl_s, max_tenants
        self._tenants: dict[str, TTLCache[str, float]] = {}
        self._lock = threading.Lock()
        self._timer = timer

    def for_tenant(self, tenant: str | None) -> "TenantCooldowns":
        """The view of this map that one tenant's sessions use."""
        return TenantCooldowns(self, tenant or "")

    def size(self) -> int:
        """How many entries are held, over all tenants (never which)."""
        with self._lock:
            self._purge()
            return sum(len(entries) for entries in self._tenants.values())

    def _claim(self, key: tuple[str, str]) -> bool:
        tenant, session = key
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None:
                if len(self._tenants) >= self.max_tenants:
                    self._purge()
                if len(self._tenants) >= self.max_tenants:
                    return False  # full of other tenants' live cooldowns: skip this warm, evict no one
                entries = self._tenants[tenant] = TTLCache(self.maxsize, self.ttl_s, timer=self._timer)
            if session in entries:
                return False
            entries[session] = self._timer()
            return True

    def _active(self, key: tuple[str, str]) -> bool:
        tenant, session = key
        with self._lock:
            entries = self._tenants.get(tenant)
            return entries is not None and session in entries

    def _reset(self, key: tuple[str, str]) -> None:
        tenant, session = key
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is not None:
                entries.pop(session, None)
                if not entries:
                    del self._tenants[tenant]

    def _purge(self) -> None:
        """Drop expired entries and tenants left with none (the lock held)."""
        for tenant, entries in list(self._tenants.items()):
            entries.expire()
            if not entries:
                del self._tenants[tenant]


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
