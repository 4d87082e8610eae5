"""The in-process store: today's guards, one per process, and no shared windows (the default)."""

from __future__ import annotations

import itertools
import threading
import time
import math
from typing import Callable, Collection, Sequence

from agentkv.state.protocol import ClaimOutcome, Lease, SharedWindow, WarmClaim
from agentkv.state.guards import CooldownMap, InFlightLimit, shared_cooldowns, shared_in_flight

_TOKENS = itertools.count()


class InProcessStore:
    """Cooldowns in a :class:`CooldownMap` (bounded per tenant, as the Redis store's: a tenant can evict only
    its own entries), slots in an :class:`InFlightLimit`, both process-wide unless given; claims are atomic
    under the map's lock. Windows stay in each
    :class:`~agentkv.discovery.WindowDiscovery`'s own cache (``read_window`` answers None)."""

    def __init__(self, cooldowns: CooldownMap | None = None, in_flight: InFlightLimit | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cooldowns, self._in_flight = cooldowns, in_flight
        self._slots: dict[str, InFlightLimit] = {}
        self._down: dict[str, float] = {}  # replica -> when its cool-off ends (bounded: expired marks are dropped)
        self._down_lock = threading.Lock()
        self._clock = clock
        self._homes: dict[str, dict[str, tuple[str, float]]] = {}  # pool -> conversation -> (home, last seen)

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
                     slack: float, idle_s: float) -> str:
        now = self._clock()
        with self._down_lock:
            homes = self._homes.setdefault(pool, {})
            _forget_idle(homes, now - idle_s)
            found = homes.pop(conversation, None)
            if found is not None and found[0] in ranked:
                homes[conversation] = (found[0], now)  # to the end: the dict stays in last-seen order
                return found[0]
            home = new_home(ranked, down, [h for h, _ in homes.values()], slack)
            if len(homes) < _MAX_HOMES:
                homes[conversation] = (home, now)
            return home

    async def ahome_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                            slack: float, idle_s: float) -> str:
        return self.home_replica(pool, conversation, ranked, down, slack=slack, idle_s=idle_s)


def new_home(ranked: Sequence[str], down: Collection[str], homes: Collection[str], slack: float) -> str:
    """A new conversation's home (pure): the first of ``ranked`` not ``down`` with fewer active conversations (its
    count in ``homes``, the active conversations' homes) than ``ceil(slack * (active + 1) / up)``."""
    up = [replica for replica in ranked if replica not in down] or list(ranked)
    counts = {replica: 0 for replica in up}
    for home in homes:
        if home in counts:
            counts[home] += 1
    cap = math.ceil(slack * (sum(counts.values()) + 1) / len(up))
    return next((replica for replica in up if counts[replica] < cap), up[0])


def _forget_idle(homes: dict[str, tuple[str, float]], before: float) -> None:
    """Drop the conversations last seen at ``before`` or earlier (``homes`` is in last-seen order: the oldest first)."""
    while homes:
        oldest = next(iter(homes))
        if homes[oldest][1] > before:
            return
        del homes[oldest]


_MAX_HOMES = 100_000  # active conversations per pool this store remembers
_MAX_DOWN = 4096  # replicas marked down at once, per store
