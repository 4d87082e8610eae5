"""One Session's warm-ahead: the guards in order, firing on threads or tasks, and what was warmed.

The decision itself is :func:`agentkv.warm.decide_warm` (pure); this class adds the stateful guards
(tenant-scoped cooldown, process-wide in-flight bound), counts every outcome, and runs the one-token
request without ever blocking or raising into the caller.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from agentkv import _env
from agentkv.events import emit
from agentkv.stats import SessionStats
from agentkv.tokens import Payload
from agentkv.warm import InFlightLimit, TenantCooldowns, WarmAheadPolicy, decide_warm
from agentkv.warm_runner import AsyncWarms, default_pool

_COUNTED_SKIPS = ("disabled", "unknown_model", "cooldown", "saturated")


class WarmAhead:
    """Warm-ahead for one (tenant, session): ``consider`` decides and claims, ``fire_*`` sends."""

    def __init__(self, policy: WarmAheadPolicy, cooldowns: TenantCooldowns, in_flight: InFlightLimit,
                 stats: SessionStats, client: Callable[[], Any], *, session_id: str, tenant: str | None) -> None:
        self.policy = policy
        self._cooldowns, self._in_flight, self._stats = cooldowns, in_flight, stats
        self._client = client
        self._session_id, self._tenant = session_id, tenant
        self.warmed: Payload | None = None
        self._threads: list[threading.Event] = []
        self._tasks = AsyncWarms()

    def consider(self, payload: Payload, *, estimated_tokens: int, fast_window: int | None, routed_role: str,
                 model_known: bool) -> str:
        """The outcome for this request ("fire" or why not), counted; a "fire" has claimed its slot."""
        decision = decide_warm(estimated_tokens=estimated_tokens, fast_window=fast_window, routed_role=routed_role,
                               enabled=_env.warm_ahead_enabled(), model_known=model_known, policy=self.policy)
        outcome = self._claim() if decision.fire else decision.outcome
        if outcome in _COUNTED_SKIPS:
            self._stats.add(f"warm_skipped_{outcome}")
        if outcome == "fire":
            self._stats.add("warm_fired")
            self.warmed = payload
            emit("warm_fired", estimate=estimated_tokens, session=self._session_id, tenant=self._tenant)
        return outcome

    def _claim(self) -> str:
        if self._cooldowns.active(self._session_id):
            return "cooldown"
        if not self._in_flight.try_acquire():
            return "saturated"
        if not self._cooldowns.claim(self._session_id):
            self._in_flight.release()
            return "cooldown"
        return "fire"

    def fire(self, build: Callable[[], dict[str, Any]], *, asynchronous: bool) -> None:
        """Build the warm request and send it; a failure to build is counted, never raised."""
        try:
            call = build()
        except Exception as exc:  # a warm never raises into the caller
            self._in_flight.release()
            self._failed(exc)
            return
        (self.fire_async if asynchronous else self.fire_sync)(call)

    def fire_sync(self, call: dict[str, Any]) -> None:
        """Send ``call`` on a daemon worker thread, in a copy of the caller's context."""
        done = threading.Event()
        self._threads = [e for e in self._threads if not e.is_set()] + [done]

        def job() -> None:
            try:
                self._client().completion(**call)
                self._stats.add("warm_completed")
            except Exception as exc:  # a warm never raises into anyone
                self._failed(exc)
            finally:
                self._in_flight.release()
                done.set()

        default_pool().submit(job)

    def fire_async(self, call: dict[str, Any]) -> None:
        """Send ``call`` as an asyncio task bounded by the policy's timeout."""
        async def job() -> None:
            try:
                await self._client().acompletion(**call)
                self._stats.add("warm_completed")
            except Exception as exc:  # a warm never raises into anyone
                self._failed(exc)
            finally:
                self._in_flight.release()

        self._tasks.spawn(job, self.policy.timeout_s + 1.0)

    def _failed(self, exc: BaseException) -> None:
        self._stats.add("warm_failed")
        emit("warm_failed", level="warning", error=type(exc).__name__, detail=str(exc)[:200],
             session=self._session_id, tenant=self._tenant)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for threaded warms; True when none is left in flight."""
        deadline = time.monotonic() + timeout_s
        return all(event.wait(max(0.0, deadline - time.monotonic())) for event in list(self._threads))

    async def adrain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for warm tasks."""
        await self._tasks.wait(timeout_s)
