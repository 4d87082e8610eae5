"""Sending warm-ahead requests: one Session's guards in order, then a daemon thread or an asyncio task.

The decision is :func:`agentkv.warm.policy.decide_warm` (pure); :class:`WarmAhead` adds the stateful
guards (tenant-scoped cooldown, process-wide in-flight bound), counts every outcome, and sends the
one-token request without ever blocking or raising into the caller. It is handed data (the request,
the client), never callbacks into the Session.

Threads are daemons and every warm has a timeout, so closing a Session or exiting the interpreter
never waits on one. Context variables are copied into the worker (a thread does not inherit them).
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from typing import Any, Awaitable, Callable

from agentkv._defaults import process_default
from agentkv._http import HttpTransport
from agentkv.events import emit
from agentkv.stats import SessionStats
from agentkv.tokens import Payload
from agentkv.warm.guards import InFlightLimit, TenantCooldowns
from agentkv.warm.policy import WarmAheadPolicy, decide_warm

__all__ = ["AsyncTasks", "BackgroundJobs", "DaemonPool", "WarmAhead", "default_pool"]

_COUNTED_SKIPS = ("disabled", "unknown_model", "cooldown", "saturated")
_Job = Callable[[], Any]


class DaemonPool:
    """A small pool of daemon worker threads that run jobs in the submitter's copied context."""

    def __init__(self, workers: int = 4, name: str = "agentkv-warm") -> None:
        self._jobs: queue.SimpleQueue[tuple[contextvars.Context, _Job]] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: _Job) -> None:
        """Queue ``job`` to run in a copy of the current context."""
        self._jobs.put((contextvars.copy_context(), job))

    def _work(self) -> None:
        while True:
            context, job = self._jobs.get()
            try:
                context.run(job)
            except BaseException as exc:  # a worker must survive anything a job does
                emit("warm_worker_error", level="error", error=type(exc).__name__)


default_pool = process_default(DaemonPool, "The process-wide pool of background worker threads.")


class AsyncTasks:
    """Holds references to background tasks so they are not garbage-collected mid-flight."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Awaitable[Any], timeout_s: float) -> asyncio.Task[Any]:
        """Start ``work`` as a task bounded by ``timeout_s``; its errors go to its own handler."""
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(work, timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the tasks in flight (tests and benchmarks use it)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


class BackgroundJobs:
    """One owner's background work: jobs on the shared daemon pool and tasks on the running loop."""

    def __init__(self) -> None:
        self._threads: list[threading.Event] = []
        self._tasks = AsyncTasks()

    def thread(self, job: _Job) -> None:
        """Run ``job`` on the process's daemon pool; :meth:`drain` can wait for it."""
        done = threading.Event()
        self._threads = [e for e in self._threads if not e.is_set()] + [done]

        def run() -> None:
            try:
                job()
            finally:
                done.set()

        default_pool().submit(run)

    def task(self, work: Awaitable[Any], timeout_s: float) -> None:
        """Run ``work`` as a task on the running loop, bounded by ``timeout_s``."""
        self._tasks.spawn(work, timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for threaded jobs; True when none is left in flight."""
        deadline = time.monotonic() + timeout_s
        return all(event.wait(max(0.0, deadline - time.monotonic())) for event in list(self._threads))

    async def adrain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for tasks."""
        await self._tasks.wait(timeout_s)


class WarmAhead:
    """Warm-ahead for one (tenant, session): ``consider`` decides and claims, ``send``/``asend`` go out."""

    def __init__(self, policy: WarmAheadPolicy, cooldowns: TenantCooldowns, in_flight: InFlightLimit,
                 stats: SessionStats, jobs: BackgroundJobs, *, session_id: str, tenant: str | None) -> None:
        self.policy = policy
        self._cooldowns, self._in_flight, self._stats, self._jobs = cooldowns, in_flight, stats, jobs
        self._session_id, self._tenant = session_id, tenant
        self.warmed: Payload | None = None

    def consider(self, payload: Payload, *, estimated_tokens: int, fast_window: int | None, routed_role: str,
                 model_known: bool, enabled: bool) -> str:
        """The outcome for this request ("fire" or why not), counted; a "fire" has claimed its slot."""
        decision = decide_warm(estimated_tokens=estimated_tokens, fast_window=fast_window, routed_role=routed_role,
                               enabled=enabled, model_known=model_known, policy=self.policy)
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

    def abandon(self, exc: BaseException) -> None:
        """A claimed warm that could not be built: free its slot and count the failure."""
        self._in_flight.release()
        self._failed(exc)

    def send(self, call: dict[str, Any], client: Any) -> None:
        """Send ``call`` through ``client.completion`` on a daemon worker thread."""
        def job() -> None:
            try:
                client.completion(**call)
                self._stats.add("warm_completed")
            except Exception as exc:  # a warm never raises into anyone
                self._failed(exc)
            finally:
                self._in_flight.release()

        self._jobs.thread(job)

    def asend(self, call: dict[str, Any], client: Any) -> None:
        """Send ``call`` through ``client.acompletion`` as a task bounded by the policy's timeout."""
        async def job() -> None:
            try:
                await client.acompletion(**call)
                self._stats.add("warm_completed")
            except Exception as exc:  # a warm never raises into anyone
                self._failed(exc)
            finally:
                self._in_flight.release()

        self._jobs.task(job(), self.policy.timeout_s + 1.0)

    def post(self, url: str, body: dict[str, Any], http: HttpTransport) -> None:
        """POST the warm's raw ``body`` to ``url`` over the HTTP seam on a daemon worker thread."""
        def job() -> None:
            self._sent(lambda: http.post_json(url, body, timeout_s=self.policy.timeout_s))

        self._jobs.thread(job)

    def apost(self, url: str, body: dict[str, Any], http: HttpTransport) -> None:
        """POST the warm's raw ``body`` to ``url`` over the async HTTP seam, as a task."""
        async def job() -> None:
            try:
                await http.apost_json(url, body, timeout_s=self.policy.timeout_s)
                self._stats.add("warm_completed")
            except Exception as exc:  # a warm never raises into anyone
                self._failed(exc)
            finally:
                self._in_flight.release()

        self._jobs.task(job(), self.policy.timeout_s + 1.0)

    def _sent(self, send: Callable[[], Any]) -> None:
        try:
            send()
            self._stats.add("warm_completed")
        except Exception as exc:  # a warm never raises into anyone
            self._failed(exc)
        finally:
            self._in_flight.release()

    def _failed(self, exc: BaseException) -> None:
        self._stats.add("warm_failed")
        emit("warm_failed", level="warning", error=type(exc).__name__,
             status_code=getattr(exc, "status_code", None), session=self._session_id, tenant=self._tenant)
