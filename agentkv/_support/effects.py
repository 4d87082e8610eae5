"""Effects, and the two drivers that carry them out: how agentkv writes a step with I/O once for sync and async.

A step is a generator (a *machine*, as h11's and h2's protocol objects are): it never performs I/O, never sleeps
and never starts a thread. It yields what it needs done, an effect, and is sent back the result:

- :class:`Call`: call a seam (the state store, discovery, a counter, the caller's send): ``sync(*args)`` under the
  sync driver, ``await async_(*args)`` under the async one. What the call raises is thrown into the machine at the
  ``yield`` (a store's :class:`~agentkv.state.StateUnavailable` is caught where a fallback exists);
- :class:`Wait`: sleep ``delay_s`` (a retry's backoff), with the sleeper the effect names;
- :class:`Spawn`: start another machine in the background (a task under the async driver, a thread on the daemon
  pool under the sync one), never waited for; its failure never reaches the machine that spawned it;
- :class:`Offload`: CPU-bound work (torch): inline under the sync driver, on a worker thread under the async one.

A machine's ``return`` is the step's result. Machines compose with ``yield from``. A cancellation (a task's timeout,
a client that left) is thrown into the machine at its ``yield``: its ``finally`` blocks run, and the cleanup they
yield (a lease given back) is carried out before the cancellation goes on.
:func:`run` and :func:`arun` are the only places that differ by mode, and the only twins:

    def facts(store, url):                       # written once
        down = yield Call(store.down, store.adown, (url,))
        return down

    run(facts(store, url), jobs)                 # sync
    await arun(facts(store, url), jobs)          # async
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generator, Generic, Mapping, TypeVar, Union

from agentkv._support.defaults import shared
from agentkv._support.jobs import BackgroundJobs
from agentkv.events import emit

__all__ = ["Call", "Effect", "Machine", "Offload", "Raised", "Returned", "Spawn", "Wait", "arun", "run"]

R = TypeVar("R")


@dataclass(frozen=True)
class Returned(Generic[R]):
    """What a :class:`Call` with ``captures=True`` returned."""

    value: R


@dataclass(frozen=True)
class Raised:
    """What a :class:`Call` with ``captures=True`` raised: the machine decides from the value, it catches nothing."""

    error: Exception


@dataclass(frozen=True)
class Call:
    """Call a seam's method: ``sync`` under :func:`run`, ``async_`` (awaited) under :func:`arun`. ``captures``: send
    back :class:`Returned` or :class:`Raised` instead of the value (or the error thrown in)."""

    sync: Callable[..., Any]
    async_: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    captures: bool = False


@dataclass(frozen=True)
class Wait:
    """Sleep ``delay_s`` seconds (a retry's backoff): ``sleep`` under :func:`run`, ``asleep`` under :func:`arun`."""

    delay_s: float
    sleep: Callable[[float], None] = time.sleep
    asleep: Callable[[float], Awaitable[None]] = asyncio.sleep


@dataclass(frozen=True)
class Spawn:
    """Start ``job()`` (a machine) in the background, bounded by ``timeout_s`` on a loop; nothing waits for it."""

    job: Callable[[], "Machine[Any]"]
    timeout_s: float


@dataclass(frozen=True)
class Offload:
    """Run ``fn()`` (CPU-bound) and send back its result: inline under :func:`run`, on a thread under :func:`arun`."""

    fn: Callable[[], Any]


Effect = Union[Call, Wait, Spawn, Offload]
Machine = Generator[Effect, Any, R]


def run(machine: Machine[R], jobs: BackgroundJobs | None = None) -> R:
    """Carry ``machine`` to its end, performing each effect it yields; return what it returns."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = machine.send(value) if error is None else machine.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        value, error = None, None
        try:
            if isinstance(effect, Call):
                value = effect.sync(*effect.args, **effect.kwargs)
                value = Returned(value) if effect.captures else value
            elif isinstance(effect, Wait):
                effect.sleep(effect.delay_s)
            elif isinstance(effect, Spawn):
                _spawn(effect, jobs or _process_jobs())
            else:
                value = effect.fn()
        except BaseException as exc:  # the machine decides; a cancellation is thrown in, so its cleanup runs
            value, error = _failed(effect, exc)


async def arun(machine: Machine[R], jobs: BackgroundJobs | None = None) -> R:
    """The async driver: as :func:`run`, each call awaited and the background started as tasks."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = machine.send(value) if error is None else machine.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        value, error = None, None
        try:
            if isinstance(effect, Call):
                value = await effect.async_(*effect.args, **effect.kwargs)
                value = Returned(value) if effect.captures else value
            elif isinstance(effect, Wait):
                await effect.asleep(effect.delay_s)
            elif isinstance(effect, Spawn):
                held = jobs or _process_jobs()
                held.task(_aquiet(effect.job(), held), effect.timeout_s)
            else:
                value = await asyncio.to_thread(effect.fn)
        except BaseException as exc:
            value, error = _failed(effect, exc)


def _process_jobs() -> BackgroundJobs:
    """The jobs a machine spawns on when its driver was given none (a machine of a count or a cache, run alone)."""
    return shared("background_jobs", BackgroundJobs)


def _spawn(effect: Spawn, jobs: BackgroundJobs) -> None:
    """Start a background machine from the sync driver: a thread on the daemon pool, whether or not this thread runs
    an event loop (a sync call made inside one never yields to it, so a task would wait until the caller returns)."""
    jobs.thread(_in_background(effect.job, jobs))


def _failed(effect: Effect, exc: BaseException) -> tuple[Any, BaseException | None]:
    """What the machine gets back for an effect that raised: a :class:`Raised` value (an error of a capturing
    :class:`Call`), or the error thrown in (a cancellation always: the machine's ``finally`` blocks then run, and
    what they yield is carried out before the cancellation goes on)."""
    if isinstance(exc, Exception) and isinstance(effect, Call) and effect.captures:
        return Raised(exc), None
    return None, exc


def _in_background(job: Callable[[], Machine[Any]], jobs: BackgroundJobs) -> Callable[[], None]:
    def go() -> None:
        try:
            run(job(), jobs)
        except Exception as exc:  # a background job's failure never reaches anyone
            emit("background_job_failed", level="warning", error=type(exc).__name__)

    return go


async def _aquiet(machine: Machine[Any], jobs: BackgroundJobs) -> None:
    try:
        await arun(machine, jobs)
    except Exception as exc:
        emit("background_job_failed", level="warning", error=type(exc).__name__)
