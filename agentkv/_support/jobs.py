"""Background work: a process-wide pool of daemon threads, and one owner's jobs (threads and tasks) that tests and
benchmarks can wait for. A job's failure never reaches whoever started it.

    jobs = BackgroundJobs()
    jobs.thread(lambda: send_warm())          # on the daemon pool
    jobs.task(asend_warm(), timeout_s=30.0)   # on the running loop
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from typing import Any, Awaitable, Callable

from agentkv._support.defaults import process_default
from agentkv.events import emit

__all__ = ["AsyncTasks", "BackgroundJobs", "DaemonPool", "default_pool"]

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
        task.add_done_callback(_retrieved)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the tasks in flight (tests and benchmarks use it)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    @property
    def pending(self) -> bool:
        """Whether a task is still in flight."""
        return any(not task.done() for task in self._tasks)


def _retrieved(task: "asyncio.Task[Any]") -> None:
    """A background task that ended in an error (its timeout, most often): said once, never left for asyncio's
    "exception was never retrieved" at garbage collection."""
    if not task.cancelled() and task.exception() is not None:
        emit("background_job_failed", level="warning", error=type(task.exception()).__name__)


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
        """Wait up to ``timeout_s`` for threaded jobs, and the jobs they queued (a health check's re-warm); True when
        none is left in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = [event for event in list(self._threads) if not event.is_set()]
            if not left:
                return True
            if not all(event.wait(max(0.0, deadline - time.monotonic())) for event in left):
                return False

    async def adrain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for tasks, and the tasks they started."""
        deadline = time.monotonic() + timeout_s
        while self._tasks.pending and time.monotonic() < deadline:
            await self._tasks.wait(max(0.0, deadline - time.monotonic()))
