"""The in-process store: today's guards, one per process, and no shared windows (the default)."""

from __future__ import annotations

import itertools

from agentkv.state.protocol import ClaimOutcome, Lease, SharedWindow, WarmClaim
from agentkv.state.guards import CooldownMap, InFlightLimit, shared_cooldowns, shared_in_flight

_TOKENS = itertools.count()


class InProcessStore:
    """Cooldowns in a :class:`CooldownMap` (bounded per tenant, as the Redis store's: a tenant can evict only
    its own entries), slots in an :class:`InFlightLimit`, both process-wide unless given; claims are atomic
    under the map's lock. Windows stay in each
    :class:`~agentkv.discovery.WindowDiscovery`'s own cache (``read_window`` answers None)."""

    def __init__(self, cooldowns: CooldownMap | None = None, in_flight: InFlightLimit | None = None) -> None:
        self._cooldowns, self._in_flight = cooldowns, in_flight
        self._slots: dict[str, InFlightLimit] = {}

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
