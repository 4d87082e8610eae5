"""Window discovery: declared, discovered from the server, or from litellm's catalog.

Discovered windows and served model ids live in a thread-safe ``TTLCache`` (15 minutes by default,
keyed by ``(api_base, model)``) so that a swap slot which loads another model is read again. A failed
``GET /models`` is remembered only briefly (seconds, backing off), never over a success; one fetch per
backend is in flight at a time, sync and async callers alike waiting for it.

With a shared :class:`~agentkv.state.StateStore` (``state=``), the discovered window and every
correction are also read from and written to the store, so a window one replica learns from an
overflow is used by every replica on its next request; while the store is unreachable each process
falls back to its own cache.

A server that cut a request's output budget silently (vLLM 0.32 answers 200 with ``finish_reason:
"length"``) holds less than the window the request was routed with: :meth:`WindowDiscovery.rediscover`
forgets that backend's answers and reads its server on the next lookup, even for a declared window, which
the server's ``max_model_len`` then replaces.

Usage::

    fast = Backend("hosted_vllm/qwen3-8b", api_base="http://127.0.0.1:8001/v1")
    info = default_discovery().window(fast)         # WindowInfo(window=32768, source="server", ...)
    info = await default_discovery().awindow(fast)  # the same over async HTTP
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from cachetools import TTLCache

from agentkv._support.defaults import process_default, shared
from agentkv._support.effects import Call, Machine, Offload, Raised, Returned, arun, run
from agentkv.http.transport import HttpError, HttpTransport, default_http
from agentkv.backends import Backend, ServerInfo, WindowInfo, catalog_window, parse_models_response, positive_window
from agentkv.events import emit
from agentkv.state.memory import InProcessStore
from agentkv.state.protocol import SharedWindow, StateStore, StateUnavailable

__all__ = ["DEFAULT_WINDOW_TTL_S", "WindowDiscovery", "default_discovery", "discovery_for"]

DEFAULT_WINDOW_TTL_S = 900.0
# A server clamp sends a backend back to its server at most this often (a server capping output on its own
# clamps every request; its window need not be read every time).
REREAD_AFTER_CLAMP_S = 30.0

class _Flight:
    """One ``GET /models`` in flight; sync and async latecomers wait for it instead of sending their own."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def land(self) -> None:
        with self._lock:
            self.done.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future)

    async def wait(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.done.is_set():
                return
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return


_NO_FLIGHT = _Flight()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Failing:
    """A backend whose ``/models`` fails: when to ask again, and how many failures in a row."""

    retry_at: float
    streak: int


class WindowDiscovery:
    """Discovers windows and served model ids, caching them per ``(api_base, model)`` with a TTL.

    ``timer`` drives the TTL and the failure back-off (inject a fake clock in tests); ``http`` is the
    HTTP seam (:func:`agentkv.http.transport.default_http` unless given). A failure is retried after
    ``retry_s`` seconds, doubling per failure in a row up to ``max_retry_s``; meanwhile the last
    good answer (if any) stands. Failures are logged once per episode and never raised.
    ``state`` shares windows and corrections across replicas (None: this process only).
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_WINDOW_TTL_S,
        *,
        timer: Callable[[], float] = time.monotonic,
        http: HttpTransport | None = None,
        timeout_s: float = 3.0,
        maxsize: int = 1024,
        retry_s: float = 2.0,
        max_retry_s: float = 60.0,
        state: StateStore | None = None,
    ) -> None:
        self._cache: TTLCache[tuple[str, str], ServerInfo] = TTLCache(maxsize, ttl_s, timer=timer)
        self._last_good: dict[tuple[str, str], ServerInfo] = {}
        self._failing: dict[tuple[str, str], _Failing] = {}
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._fallback_warned: set[tuple[str, str]] = set()
        self._contested: set[tuple[str, str]] = set()  # declared windows a server clamp called into question
        self._reread_at: dict[tuple[str, str], float] = {}  # when a clamp last sent a backend back to its server
        self._corrections: TTLCache[tuple[str, str], int] = TTLCache(maxsize, ttl_s, timer=timer)
        self._lock = threading.Lock()
        self._timer = timer
        self._http = http or default_http()
        self._timeout_s = timeout_s
        self._retry = (retry_s, max_retry_s)
        self._state, self._ttl_s = state, ttl_s
        self._publishing: set[asyncio.Task[None]] = set()
        self._recent: dict[tuple[str, str, bool], tuple[WindowInfo, float]] = {}  # the last answers, and when

    # --------------------------------------------------------------- answers (one machine, driven sync or async)
    def window(self, backend: Backend, *, model_known: bool = True) -> WindowInfo:
        """The backend's window (declared, corrected, server, then litellm's catalog; a server's overflow
        correcting a declared window downwards wins over it) and, unless
        ``model_known=False``, whether its model is known; may ``GET /models`` (cached) and, for cloud
        models, import litellm (a self-hosted model's catalog entry is read only once litellm is loaded)."""
        return run(self.finding(backend, model_known=model_known))

    async def awindow(self, backend: Backend, *, model_known: bool = True) -> WindowInfo:
        """:meth:`window` for async callers: HTTP is awaited, litellm's import runs on a worker thread."""
        return await arun(self.finding(backend, model_known=model_known))

    def finding(self, backend: Backend, *, model_known: bool = True) -> Machine[WindowInfo]:
        """:meth:`window` as a machine: the store's read, the server's ``/models`` and the catalog are effects."""
        shared = yield from self._reading_shared(backend, model_known)
        info = _shared_info(shared)
        if info is None and (_needs_server(backend, model_known) or self._is_contested(backend)):
            info = yield from self.fetching_info(backend)
        needed = _needs_catalog(backend, info, model_known) and _catalog_open(backend)
        # off the loop under the async driver: litellm's import, or a lookup (milliseconds) once it is loaded
        catalog = (yield Offload(partial(catalog_window, backend.model))) if needed else None
        return self._remember(backend, model_known, self._resolve(backend, info, catalog, shared))

    def recent(self, backend: Backend, *, model_known: bool = True, max_age_s: float = 1.0) -> WindowInfo | None:
        """The last answer :meth:`window` or :meth:`awindow` gave for ``backend`` if it is under ``max_age_s``
        old, else None: no I/O and no lock (what a caller may act on before it asks again)."""
        recent = self._recent.get((*_key(backend), model_known))
        if recent is None or self._timer() - recent[1] > max_age_s:
            return None
        return recent[0]

    def _remember(self, backend: Backend, model_known: bool, info: WindowInfo) -> WindowInfo:
        key = (*_key(backend), model_known)
        if key in self._recent or len(self._recent) < 4096:
            self._recent[key] = (info, self._timer())
        return info

    def served_model_known(self, backend: Backend) -> bool:
        """True only when the server lists the configured model (cloud backends: the catalog knows it)."""
        return bool(self.window(backend).model_known)

    def server_info(self, backend: Backend) -> ServerInfo | None:
        """The cached or freshly fetched ``/models`` answer (the last good one while failing), or None."""
        return run(self.fetching_info(backend))

    def fetching_info(self, backend: Backend) -> Machine[ServerInfo | None]:
        """:meth:`server_info` as a machine, sharing the cache and the single flight with every caller."""
        action, key, flight = self._next(backend)
        if action == "fetch":
            try:
                answer = yield Call(self._http.request, self._http.arequest, ("GET", _models_url(backend)),
                                    {"timeout_s": self._timeout_s}, captures=True)
                result = _parsed(answer, backend)
                self._landed(key, backend, result)
                if isinstance(result, ServerInfo):
                    yield from self._writing(backend, SharedWindow(result.window, result.model_listed))
            finally:
                self._release(key, flight)
        elif action == "wait":
            yield Call(flight.done.wait, flight.wait, (self._timeout_s + 1.0,))
        return self._cached(key)[1]

    # --------------------------------------------------------------- corrections
    def correct(self, backend: Backend, window: int) -> None:
        """Record the window a server reported in an overflow error when it disagrees with ours (no I/O)."""
        self._recent.clear()  # what the last answers said may no longer hold
        if positive_window(window) is None:
            return
        key = _key(backend)
        with self._lock:
            cached = self._cache.get(key) or self._last_good.get(key)
            known = self._corrections.get(key) or backend.window or (cached.window if cached else None)
            if known == window:
                return
            self._corrections[key] = window
        emit("window_stale", level="warning", backend=backend.label, cached=known, server=window)
        self._publish(backend, SharedWindow(correction=window))

    def rediscover(self, backend: Backend) -> None:
        """After the server cut a request's output budget (a silent clamp): forget ``backend``'s cached answers
        and corrections, and read its server on the next lookup; a declared window the server's
        ``max_model_len`` contradicts gives way to it from then on (no I/O here). A server that keeps cutting
        budgets (an output cap of its own) is read again at most once per :data:`REREAD_AFTER_CLAMP_S`."""
        self._recent.clear()  # what the last answers said may no longer hold
        key, now = _key(backend), self._timer()
        with self._lock:
            due = now - self._reread_at.get(key, -REREAD_AFTER_CLAMP_S) >= REREAD_AFTER_CLAMP_S
            if due:
                self._reread_at[key] = now
        if due:
            self.invalidate(backend)
        with self._lock:
            if backend.window is not None and backend.self_hosted:
                self._contested.add(key)
        emit("window_rediscover", level="warning" if due else "debug", backend=backend.label,
             declared=backend.window, reread=due)

    def _is_contested(self, backend: Backend) -> bool:
        with self._lock:
            return _key(backend) in self._contested

    # --------------------------------------------------------------- the shared store (if any)
    def _reading_shared(self, backend: Backend, model_known: bool) -> Machine[SharedWindow | None]:
        if self._state is None or not _shares(backend, model_known):
            return None
        read = yield Call(self._state.read_window, self._state.aread_window, (_store_key(backend),), captures=True)
        if isinstance(read, Raised):
            if isinstance(read.error, StateUnavailable):
                return None  # this process's own cache answers
            raise read.error
        return read.value  # type: ignore[no-any-return]

    def _publish(self, backend: Backend, window: SharedWindow) -> None:
        """Write to the store: directly on a plain thread, as a task on a running event loop."""
        if self._state is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            run(self._writing(backend, window))
            return
        task = loop.create_task(arun(self._writing(backend, window)))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    def _writing(self, backend: Backend, window: SharedWindow) -> Machine[None]:
        if self._state is None:
            return
        done = yield Call(self._state.write_window, self._state.awrite_window, (_store_key(backend), window, self._ttl_s),
                          captures=True)
        if isinstance(done, Raised) and not isinstance(done.error, StateUnavailable):
            raise done.error  # unavailable: the others relearn it; this process has it

    def invalidate(self, backend: Backend | None = None) -> None:
        """Forget one backend's cached answers, or all of them."""
        self._recent.clear()  # what the last answers said may no longer hold
        with self._lock:
            stores: list[Any] = [self._cache, self._corrections, self._last_good, self._failing]
            if backend is None:
                self._contested.clear()
            else:
                self._contested.discard(_key(backend))
            for store in stores:
                if backend is None:
                    store.clear()
                else:
                    store.pop(_key(backend), None)
            if backend is None:
                self._fallback_warned.clear()
            else:
                self._fallback_warned.discard(_key(backend))

    # --------------------------------------------------------------- internals
    def _resolve(self, backend: Backend, info: ServerInfo | None, catalog: int | None,
                 shared: SharedWindow | None = None) -> WindowInfo:
        known = (catalog is not None) if backend.is_cloud else (info.model_listed if info else None)
        key = _key(backend)
        with self._lock:
            corrected = (shared.correction if shared else None) or self._corrections.get(key)
        declared = None if self._overruled(backend, info) else backend.window  # a clamp contested it: the server wins
        if declared is not None and (corrected is None or corrected >= declared):
            return WindowInfo(declared, "declared", known)  # a server's refusal only ever lowers it
        if corrected is not None:
            return WindowInfo(corrected, "corrected", known)
        if info is not None and info.window is not None:
            return WindowInfo(info.window, "server", known)
        source = "catalog" if catalog else "unknown"
        self._warn_fallback(key, backend, source)
        return WindowInfo(catalog, source, known)

    def _overruled(self, backend: Backend, info: ServerInfo | None) -> bool:
        """A declared window a server clamp contested, and the server reports another."""
        server = info.window if info is not None else None
        return server is not None and server != backend.window and self._is_contested(backend)

    def _warn_fallback(self, key: tuple[str, str], backend: Backend, source: str) -> None:
        with self._lock:
            first = key not in self._fallback_warned
            self._fallback_warned.add(key)
        emit("window_fallback", level="warning" if first else "debug", backend=backend.label, source=source)

    def _cached(self, key: tuple[str, str]) -> tuple[bool, ServerInfo | None]:
        """(answered, info): a fresh success, or the last good answer while a failure backs off."""
        with self._lock:
            if key in self._cache:
                return True, self._cache[key]
            failing = self._failing.get(key)
            if failing is not None and self._timer() < failing.retry_at:
                return True, self._last_good.get(key)
            return False, None

    def _next(self, backend: Backend) -> tuple[str, tuple[str, str], _Flight]:
        """What a lookup does: "answer" from the cache, "wait" for the fetch in flight, or "fetch" as its leader."""
        key = _key(backend)
        if not backend.self_hosted or self._cached(key)[0]:
            return "answer", key, _NO_FLIGHT  # a hosted API's /models names no window: never asked
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                return "wait", key, flight
            flight = self._flights[key] = _Flight()
            return "fetch", key, flight

    def _release(self, key: tuple[str, str], flight: _Flight) -> None:
        with self._lock:
            self._flights.pop(key, None)
        flight.land()

    def _landed(self, key: tuple[str, str], backend: Backend, result: ServerInfo | BaseException) -> None:
        if isinstance(result, ServerInfo):
            self._succeeded(key, backend, result)
        else:
            self._failed(key, backend, result)

    def _succeeded(self, key: tuple[str, str], backend: Backend, info: ServerInfo) -> None:
        with self._lock:
            self._cache[key] = info
            old = self._last_good.get(key)
            self._last_good[key] = info
            recovered = self._failing.pop(key, None)
            self._fallback_warned.discard(key)
        if recovered is not None:
            emit("discovery_recovered", backend=backend.label, failures=recovered.streak)
        if old is not None and old.window is not None and info.window is not None and old.window != info.window:
            emit("window_changed", level="warning", backend=backend.label, old=old.window, new=info.window)

    def _failed(self, key: tuple[str, str], backend: Backend, exc: BaseException) -> None:
        base, cap = self._retry
        with self._lock:
            streak = self._failing[key].streak + 1 if key in self._failing else 1
            backoff = min(cap, base * 2 ** (streak - 1))
            self._failing[key] = _Failing(self._timer() + backoff, streak)
        emit("discovery_failed", level="warning" if streak == 1 else "debug", backend=backend.label,
             error=type(exc).__name__, status_code=getattr(exc, "status_code", None), failures=streak,
             retry_in_s=backoff)


def _parsed(answer: Returned[Any] | Raised, backend: Backend) -> ServerInfo | BaseException:
    """A ``/models`` answer parsed, or what failed (an HTTP error, or an answer that is not one)."""
    if isinstance(answer, Raised):
        if isinstance(answer.error, (HttpError, ValueError)):  # a transport of the caller's may raise either
            return answer.error
        raise answer.error
    try:
        return parse_models_response(answer.value, backend.served_model)
    except ValueError as exc:
        return exc


def _needs_server(backend: Backend, model_known: bool) -> bool:
    return backend.self_hosted and (backend.window is None or model_known)


def _catalog_open(backend: Backend) -> bool:
    """Whether litellm's catalog may be asked for ``backend``'s window. A cloud backend's always (its requests
    need litellm anyway); a self-hosted one asks only when its server cannot say (it is down), on the request's
    path, so only with litellm loaded already (a model the caller registered with ``litellm.register_model``):
    its import takes seconds."""
    return backend.is_cloud or "litellm" in sys.modules


def _needs_catalog(backend: Backend, info: ServerInfo | None, model_known: bool) -> bool:
    if backend.window is not None:
        return backend.is_cloud and model_known
    return backend.is_cloud or info is None or info.window is None


def _shares(backend: Backend, model_known: bool) -> bool:
    """Whether the store can add anything: a window to discover or correct, or a listing to read."""
    return backend.window is None or (model_known and backend.self_hosted)


def _shared_info(shared: SharedWindow | None) -> ServerInfo | None:
    if shared is None or shared.model_listed is None:
        return None
    return ServerInfo(shared.window, frozenset(), shared.model_listed)


def _store_key(backend: Backend) -> str:
    return f"{backend.api_base or ''}|{backend.model}"


def _models_url(backend: Backend) -> str:
    return f"{(backend.api_base or '').rstrip('/')}/models"


def _key(backend: Backend) -> tuple[str, str]:
    return (backend.api_base or "", backend.model)


default_discovery = process_default(
    WindowDiscovery, "The process-wide discovery cache that Sessions share unless given their own.")


def discovery_for(state: StateStore) -> WindowDiscovery:
    """The process's discovery for ``state``: the default one, or one sharing windows through it."""
    if isinstance(state, InProcessStore):
        return default_discovery()
    return shared(("discovery", state), lambda: WindowDiscovery(state=state))
