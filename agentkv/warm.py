"""Warm-ahead: a one-token request that makes the big model prefill the conversation early.

When a session's estimated input crosses ``threshold`` x the fast window, agentkv sends the slow
backend the same messages, tools and salt with ``max_tokens=1`` and does not wait for it. The slow
server's prefix cache then holds the conversation when escalation comes.

The decision is pure (:func:`decide_warm`); the guards that hold state are the tenant-scoped
:class:`CooldownMap` and the process-wide :class:`InFlightLimit`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

from cachetools import TTLCache

from agentkv.errors import ConfigurationError, check_positive_int

WarmOutcome = Literal[
    "fire", "below_threshold", "disabled", "routed_slow", "unknown_model", "no_window", "cooldown", "saturated"
]


@dataclass(frozen=True)
class WarmAheadPolicy:
    """When and how often warm-ahead fires.

        WarmAheadPolicy(threshold=0.6, cooldown_s=300, max_sessions=256, max_in_flight=4, timeout_s=30)

    ``threshold`` is a fraction of the fast window (0.6: at 0.9 the warm arrives too late);
    ``cooldown_s`` bounds warms to one per (tenant, session) per period; ``max_sessions`` bounds the
    cooldown map; ``max_in_flight`` bounds concurrent warms per process; ``timeout_s`` bounds each warm.
    """

    threshold: float = 0.6
    cooldown_s: float = 300.0
    max_sessions: int = 256
    max_in_flight: int = 4
    timeout_s: float = 30.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigurationError(f"WarmAheadPolicy.threshold must be in (0, 1], got {self.threshold!r}")
        for name in ("cooldown_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"WarmAheadPolicy.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("max_sessions", "max_in_flight"):
            check_positive_int("WarmAheadPolicy", name, getattr(self, name))


@dataclass(frozen=True)
class WarmDecision:
    """Whether to warm now, and the outcome name counted in stats."""

    outcome: WarmOutcome

    @property
    def fire(self) -> bool:
        return self.outcome == "fire"


def decide_warm(
    *,
    estimated_tokens: int,
    fast_window: int | None,
    routed_role: str,
    enabled: bool,
    model_known: bool,
    policy: WarmAheadPolicy,
) -> WarmDecision:
    """The stateless part of the warm-ahead decision (cooldown and in-flight limits come after)."""
    if fast_window is None:
        return WarmDecision("no_window")
    if estimated_tokens < policy.threshold * fast_window:
        return WarmDecision("below_threshold")
    if routed_role == "slow":
        return WarmDecision("routed_slow")  # the request itself warms the slow cache
    if not enabled or not policy.enabled:
        return WarmDecision("disabled")
    if not model_known:
        return WarmDecision("unknown_model")
    return WarmDecision("fire")


class CooldownMap:
    """At most one warm per (tenant, session) per ``ttl_s``, in a bounded, locked ``TTLCache``.

    Many Sessions share one map (:func:`default_cooldowns`). It offers no way to list keys; a Session
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


_SHARED: dict[tuple[Any, ...], Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = make()
        return _SHARED[key]


def shared_cooldowns(maxsize: int = 256, ttl_s: float = 300.0) -> CooldownMap:
    """The process-wide cooldown map for these settings: Sessions with equal policies share one."""
    return _shared(("cooldowns", maxsize, ttl_s), lambda: CooldownMap(maxsize, ttl_s))


def shared_in_flight(limit: int = 4) -> InFlightLimit:
    """The process-wide in-flight bound for this limit."""
    return _shared(("in_flight", limit), lambda: InFlightLimit(limit))


def default_cooldowns() -> CooldownMap:
    """The process-wide cooldown map (256 entries, 5 minutes)."""
    return shared_cooldowns()


def default_in_flight() -> InFlightLimit:
    """The process-wide in-flight bound (4 warms)."""
    return shared_in_flight()
