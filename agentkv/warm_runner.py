"""Fire-and-forget execution of warm-ahead requests: daemon threads for sync, tasks for async.

A warm never blocks or raises into the caller. Threads are daemons and every warm has a timeout, so
closing a Session or exiting the interpreter never waits on one. Context variables are copied into
the worker (a thread does not inherit them).
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from typing import Any, Awaitable, Callable

from agentkv._defaults import process_default
from agentkv.events import emit

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


default_pool = process_default(DaemonPool, "The process-wide pool of warm-ahead worker threads.")


class AsyncWarms:
    """Holds references to in-flight warm tasks so they are not garbage-collected mid-flight."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, make: Callable[[], Awaitable[Any]], timeout_s: float) -> asyncio.Task[Any]:
        """Start ``make()`` as a task bounded by ``timeout_s``; its errors go to its own handler."""
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(make(), timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for in-flight warms (tests and benchmarks use it)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
