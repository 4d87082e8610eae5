"""The in-process store: today's guards, one per process, and no shared windows (the default)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, OrderedDict
from typing import Callable, Collection, Sequence

from agentkv.fleet.rendezvous import HOME_MAX_ACTIVE, HOME_TENANT_SHARE, first_up, home_by_load, tenant_cap
from agentkv.state.protocol import checked_home_bounds, ClaimOutcome, Lease, SharedWindow, WarmClaim
from agentkv.state.guards import CooldownMap, InFlightLimit, shared_cooldowns, shared_in_flight

_TOKENS = itertools.count()
FORGET_PER_CALL = 16  # idle conversations a placement forgets at most (more than the one it may add: the backlog drains)
_MAX_DOWN = 4096  # replicas marked down at once, per store


class InProcessStore:
    """Cooldowns in a :class:`CooldownMap` (bounded per tenant, as the Redis store's: a tenant can evict only
    its own entries), slots in an :class:`InFlightLimit`, both process-wide unless given; claims are atomic
    under the map's lock. Windows stay in each
    :class:`~agentkv.discovery.WindowDiscovery`'s own cache (``read_window`` answers None).

    Homes: at most ``max_active`` active conversations per pool, a tenant at most ``tenant_share`` of them; a new
    conversation past either is placed by rendezvous alone (:func:`~agentkv.fleet.first_up`) and not stored."""

    def __init__(self, cooldowns: CooldownMap | None = None, in_flight: InFlightLimit | None = None, *,
                 clock: Callable[[], float] = time.monotonic, max_active: int = HOME_MAX_ACTIVE,
                 tenant_share: float = HOME_TENANT_SHARE) -> None:
        self._cooldowns, self._in_flight = cooldowns, in_flight
        self._slots: dict[str, InFlightLimit] = {}
        self._down: dict[str, float] = {}  # replica -> when its cool-off ends (bounded: expired marks are dropped)
        self._down_lock = threading.Lock()
        self._clock = clock
        self.max_active, self.tenant_share = checked_home_bounds(max_active, tenant_share)
        self._homes: dict[str, PoolHomes] = {}  # pool -> its active conversations
        self._homes_lock = threading.Lock()

    def _guards(self, claim: WarmClaim) -> tuple[CooldownMap, InFlightLimit]:
        cooldowns = self._cooldowns or shared_cooldowns(claim.max_sessions, claim.cooldown_s)
        return cooldowns, self._in_flight or shared_in_flight(claim.limit)

    def claim(self, claim: WarmClaim) -> tuple[ClaimOutcome, Lease | None]:
        cooldowns, in_flight = self._guards(claim)
        tenant = cooldowns.for_tenant(claim.tenant)
        if tenant.active(claim.session_id):
            return "cooldown", None
        if not in_flight.try_acquire():
            return "saturated", None
        if not tenant.claim(claim.session_id):
            in_flight.release()
            return "cooldown", None
        token = str(next(_TOKENS))
        self._slots[token] = in_flight
        return "fire", Lease(token, claim.limit)

    async def aclaim(self, claim: WarmClaim) -> tuple[ClaimOutcome, Lease | None]:
        return self.claim(claim)  # no I/O: a lock held for microseconds

    def release(self, lease: Lease) -> None:
        slot = self._slots.pop(lease.token, None)
        if slot is not None:
            slot.release()

    async def arelease(self, lease: Lease) -> None:
        self.release(lease)

    def read_window(self, key: str) -> SharedWindow | None:
        return None

    async def aread_window(self, key: str) -> SharedWindow | None:
        return None

    def write_window(self, key: str, window: SharedWindow, ttl_s: float) -> None:
        return None

    async def awrite_window(self, key: str, window: SharedWindow, ttl_s: float) -> None:
        return None

    def mark_down(self, key: str, ttl_s: float) -> None:
        now = self._clock()
        with self._down_lock:
            if len(self._down) >= _MAX_DOWN:
                self._down = {k: until for k, until in self._down.items() if until > now}
            if len(self._down) < _MAX_DOWN:
                self._down[key] = max(self._down.get(key, 0.0), now + ttl_s)

    async def amark_down(self, key: str, ttl_s: float) -> None:
        self.mark_down(key, ttl_s)

    def read_down(self, keys: Sequence[str]) -> frozenset[str]:
        now = self._clock()
        with self._down_lock:
            return frozenset(key for key in keys if self._down.get(key, 0.0) > now)

    async def aread_down(self, keys: Sequence[str]) -> frozenset[str]:
        return self.read_down(keys)

    def home_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                     slack: float, idle_s: float, tenant: str = "") -> str:
        now = self._clock()
        with self._homes_lock:
            homes = self._homes.get(pool)
            if homes is None:
                homes = self._homes[pool] = PoolHomes()
            homes.forget_idle(now - idle_s)
            found = homes.home_of(conversation)
            if found is not None and found in ranked:
                homes.touch(conversation, now)
                return found
            homes.forget(conversation)
            if homes.full(tenant, self.max_active, tenant_cap(self.max_active, self.tenant_share, tenant)):
                return first_up(ranked, down)  # past the bound: rendezvous alone, nothing stored
            home = home_by_load(ranked, down, homes.per_replica, slack)
            homes.keep(conversation, home, tenant, now)
            return home

    async def ahome_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                            slack: float, idle_s: float, tenant: str = "") -> str:
        return self.home_replica(pool, conversation, ranked, down, slack=slack, idle_s=idle_s, tenant=tenant)


class PoolHomes:
    """One pool's active conversations: each one's home, tenant and last request, in last-seen order (an
    ``OrderedDict``: its oldest entry is found in O(1) however many were moved), and how many are active per replica
    and per tenant. Every operation is O(1); forgetting idle conversations takes at most :data:`FORGET_PER_CALL` a
    call, more than a call adds, so the idle backlog drains."""

    __slots__ = ("entries", "per_replica", "per_tenant")

    def __init__(self) -> None:
        self.entries: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # conversation -> (home, tenant, seen)
        self.per_replica: dict[str, int] = {}
        self.per_tenant: dict[str, int] = {}

    def home_of(self, conversation: str) -> str | None:
        entry = self.entries.get(conversation)
        return None if entry is None else entry[0]

    def touch(self, conversation: str, now: float) -> None:
        """A request of an active conversation: to the end of the last-seen order."""
        home, tenant, _ = self.entries[conversation]
        self.entries[conversation] = (home, tenant, now)
        self.entries.move_to_end(conversation)

    def keep(self, conversation: str, home: str, tenant: str, now: float) -> None:
        self.entries[conversation] = (home, tenant, now)
        _add(self.per_replica, home, 1)
        _add(self.per_tenant, tenant, 1)

    def forget(self, conversation: str) -> None:
        entry = self.entries.pop(conversation, None)
        if entry is not None:
            _add(self.per_replica, entry[0], -1)
            _add(self.per_tenant, entry[1], -1)

    def forget_idle(self, before: float, most: int = FORGET_PER_CALL) -> None:
        """Forget up to ``most`` conversations last seen at ``before`` or earlier (the oldest first)."""
        for _ in range(most):
            oldest = next(iter(self.entries), None)
            if oldest is None or self.entries[oldest][2] > before:
                return
            self.forget(oldest)

    def full(self, tenant: str, max_active: int, tenant_max: int) -> bool:
        """Whether a new conversation of ``tenant`` is past the pool's bound or the tenant's share of it."""
        return len(self.entries) >= max_active or self.per_tenant.get(tenant, 0) >= tenant_max


def _add(counts: dict[str, int], key: str, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping a count that reaches zero (the maps hold active keys only)."""
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


def new_home(ranked: Sequence[str], down: Collection[str], homes: Collection[str], slack: float) -> str:
    """:func:`~agentkv.fleet.home_by_load` over a list of the active conversations' homes (counted here: for tests
    and tools; the stores keep their counts)."""
    return home_by_load(ranked, down, Counter(homes), slack)


class RecentHomes:
    """The homes this process last saw, by (pool, conversation): a bounded copy (least recently used out first) that
    a shared store answers from while it is away, and re-seeds itself from once it is back."""

    def __init__(self, size: int = 100_000, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self._clock = size, clock
        self._homes: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, pool: str, conversation: str, idle_s: float) -> str | None:
        """The home last seen for ``conversation`` in ``pool``, if that was under ``idle_s`` ago."""
        with self._lock:
            found = self._homes.get((pool, conversation))
        return found[0] if found is not None and self._clock() - found[1] < idle_s else None

    def put(self, pool: str, conversation: str, home: str) -> None:
        with self._lock:
            self._homes[(pool, conversation)] = (home, self._clock())
            self._homes.move_to_end((pool, conversation))
            if len(self._homes) > self.size:
                self._homes.popitem(last=False)
