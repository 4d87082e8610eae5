"""What replicas must share, as a Protocol: one atomic warm claim, its release, shared windows, and which backend
replicas are cooling off after an outage.

A warm claim is one step, not three: "is this (tenant, session) cooling down? is a slot free? then
take both" must not interleave with another replica's claim, so a store does it atomically (a lock
in process, a Lua script in Redis). Every method may raise :class:`StateUnavailable`; callers then
skip the warm (better no warm than an unguarded one) or fall back to their own cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Literal, Protocol, Sequence, runtime_checkable

from agentkv.errors import ConfigurationError

ClaimOutcome = Literal["fire", "cooldown", "saturated"]


def checked_home_bounds(max_active: int, tenant_share: float) -> tuple[int, float]:
    """A store's bound on a pool's active conversations and a tenant's share of it, checked."""
    if max_active < 1 or not 0 < tenant_share <= 1:
        raise ConfigurationError(f"a store's max_active must be at least 1 and its tenant_share in (0, 1], not "
                                 f"{max_active} and {tenant_share}")
    return max_active, tenant_share


class StateUnavailable(Exception):
    """The shared store did not answer in time (down, slow, or backing off after a failure)."""


@dataclass(frozen=True)
class WarmClaim:
    """One warm's claim: a cooldown for (tenant, session) and a lease on one of ``limit`` slots.

    ``max_sessions`` bounds the tenant's cooldown map (the oldest entry is evicted); a lease expires
    after ``lease_s`` even if its holder dies, so a dead replica never leaks its slot.
    """

    tenant: str
    session_id: str
    cooldown_s: float
    max_sessions: int
    limit: int
    lease_s: float


@dataclass(frozen=True)
class Lease:
    """A granted slot, handed back to :meth:`StateStore.release`."""

    token: str
    limit: int


@dataclass(frozen=True)
class SharedWindow:
    """What the store knows of one backend: the window ``/models`` reported (and whether it listed the
    model), and a correction learned from an overflow; each None when absent or expired."""

    window: int | None = None
    model_listed: bool | None = None
    correction: int | None = None


@runtime_checkable
class StateStore(Protocol):
    """Shared guards and windows. Sync methods for sync drivers; ``a``-twins never block the loop."""

    def claim(self, claim: WarmClaim) -> tuple[ClaimOutcome, Lease | None]:
        """Atomically: "cooldown" if running, else "saturated" if no slot, else "fire" with a lease."""
        ...

    async def aclaim(self, claim: WarmClaim) -> tuple[ClaimOutcome, Lease | None]: ...

    def release(self, lease: Lease) -> None:
        """Give a slot back (an expired lease is already gone: no error)."""
        ...

    async def arelease(self, lease: Lease) -> None: ...

    def read_window(self, key: str) -> SharedWindow | None:
        """The shared view of backend ``key``; None when this store shares no windows."""
        ...

    async def aread_window(self, key: str) -> SharedWindow | None: ...

    def write_window(self, key: str, window: SharedWindow, ttl_s: float) -> None:
        """Publish the window fields that are set in ``window`` (a correction, a ``/models`` answer)."""
        ...

    async def awrite_window(self, key: str, window: SharedWindow, ttl_s: float) -> None: ...

    def mark_down(self, key: str, ttl_s: float) -> None:
        """Record that replica ``key`` is down for the next ``ttl_s`` seconds (a later mark extends it)."""
        ...

    async def amark_down(self, key: str, ttl_s: float) -> None: ...

    def read_down(self, keys: Sequence[str]) -> frozenset[str]:
        """Which of ``keys`` are marked down now."""
        ...

    async def aread_down(self, keys: Sequence[str]) -> frozenset[str]: ...

    def home_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                     slack: float, idle_s: float, tenant: str = "") -> str:
        """Atomically: the replica of ``pool`` that is ``conversation``'s home (kept while it is active, its last
        request within ``idle_s``), else a new home: the first of ``ranked`` (the conversation's order of
        preference) not ``down`` whose active conversations are under ``ceil(slack * (active + 1) / up)``. A home
        that is down is still answered (the caller goes to its next replica meanwhile, and back once it is up).

        O(1) in the pool's active conversations (per-replica counts, never a scan). The store's bound on active
        conversations, and ``tenant``'s share of it, are never an error: past either, a new conversation gets the
        first of ``ranked`` not ``down`` and is not stored."""
        ...

    async def ahome_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                            slack: float, idle_s: float, tenant: str = "") -> str: ...
