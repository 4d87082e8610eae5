"""Gemini's API, and the explicit caches a Session's requests create and read, each owned by the Sessions that hold it.

A Gemini backend without ``explicit_cache`` is a managed API like any other (its implicit cache needs no marks). With
``Backend(explicit_cache=True)`` its strategy (:data:`GEMINI`) marks requests, prices the caches' storage, moves a
conversation's cache only when its tail has grown as long as its prefix, and keeps a part in each Session
(:class:`ExplicitCaches`):

A request to a ``Backend(explicit_cache=True)`` Gemini backend marks the messages it wants cached
(:func:`agentkv.wire.hosted.gemini_marked`). The Session's completion client (:meth:`ExplicitCaches.client`) then
creates that cache itself with ``POST cachedContents`` and names it in the request (``cachedContent``), sending only
the messages after it. The create answer is the one place a cache's name is certain: two Sessions (or processes, or
tenants) creating a cache on the same prefix at the same moment each get their own name back, where listing the
caches before and after a request could not tell theirs apart. litellm's own context caching, which finds a cache by
a ``displayName`` derived from its content, is never used for these backends: with it any request of the same key
and prefix reads, and a close deleting by ``displayName`` destroys, another tenant's cache.

- :class:`CacheRegistry` (one per process): the live caches by the key, tenant and content they hold, and the
  Sessions holding each. Sessions of one tenant read one cache; another tenant's requests never find it, and nothing
  outside this process learns a name (the ``displayName`` is random).
- :class:`ExplicitCaches` (one per Session): records each cache its requests create or read, and at close releases
  them, deleting only those no other Session of the process still holds (what another Session holds lapses at its
  TTL if that Session never closes). A request whose cache is gone all the same (deleted by another client of the
  key, or expired) is sent again whole: it never fails a turn.
"""

from __future__ import annotations

import copy
import hashlib
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

from agentkv._support.defaults import shared
from agentkv.backends import Backend
from agentkv.events import emit
from agentkv._support.effects import Call, Machine, Raised, arun, run
from agentkv.providers import Marks, SessionContext, loaded_prices
from agentkv.providers.managed import ManagedApi, unsalted
from agentkv.providers.prices import Prices, prices_for
from agentkv.wire.hosted import explicit_cache_moves, gemini_marked, gemini_named, gemini_unmarked, names_missing_cache
from agentkv.wire.usage import Usage

if TYPE_CHECKING:
    from agentkv._support.jobs import BackgroundJobs
    from agentkv.http.transport import HttpTransport
    from agentkv.protocols import CompletionClient
    from agentkv.stats import SessionStats

__all__ = ["EXPIRY_MARGIN_S", "GEMINI", "CacheRegistry", "CachingClient", "ExplicitCaches", "GeminiApi", "OwnedCache", "Plan",
           "ReopenedStream", "registry"]

EXPIRY_MARGIN_S = 10.0
"""A cache this close to its ``expireTime`` is not named again (litellm's margin): a new one is created."""
_TIMEOUT_S = 5.0
_MAX_NAME = 256  # the longest ``cachedContents/...`` name taken from an answer
_MAX_TOKENS = 2**31


@dataclass(frozen=True)
class Plan:
    """What a request would cache: its backend, the registry key (the API key's digest, the tenant, the content), the
    ``cachedContents`` create body less its ``displayName``, and the messages sent beside the cache."""

    backend: Backend
    key: Hashable
    body: Mapping[str, Any]
    tail: tuple[Any, ...]
    headers: Mapping[str, str] = field(repr=False)  # the API key the cache belongs to


@dataclass
class OwnedCache:
    """One explicit cache this process created: its name, what it holds, its size and lifetime, who holds it."""

    backend: Backend
    name: str
    key: Hashable
    tokens: int | None
    created_at: float  # time.monotonic(): its storage is priced from here
    lifetime_s: float | None  # from creation to its expireTime; None: unknown
    expires_at: float | None  # its expireTime, epoch seconds
    headers: Mapping[str, str] = field(repr=False)
    holders: set[str] = field(default_factory=set)


class CacheRegistry:
    """This process's live explicit caches: the one each key reads, and the Sessions holding each. ``clock`` gives
    epoch seconds (an ``expireTime`` is wall-clock)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._caches: dict[str, OwnedCache] = {}
        self._latest: dict[Hashable, str] = {}

    def acquire(self, key: Hashable, session: str) -> OwnedCache | None:
        """The live cache for ``key``, now held by ``session`` too (None: none, or one about to expire)."""
        with self._lock:
            cache = self._caches.get(self._latest.get(key, ""))
            if cache is None or (cache.expires_at is not None and cache.expires_at - EXPIRY_MARGIN_S <= self._clock()):
                return None
            cache.holders.add(session)
            return cache

    def add(self, cache: OwnedCache) -> None:
        """A cache just created (held by its creator): the one its key reads from now on."""
        with self._lock:
            self._caches[cache.name] = cache
            self._latest[cache.key] = cache.name

    def forget(self, name: str) -> None:
        """A cache found gone at the provider: never named again, never deleted."""
        with self._lock:
            self._drop(name)

    def release(self, session: str, names: Sequence[str]) -> tuple[list[OwnedCache], int]:
        """``session`` no longer holds ``names``: the caches no Session holds now (to delete), and how many of them
        another Session still holds."""
        free, kept = [], 0
        with self._lock:
            for name in names:
                cache = self._caches.get(name)
                if cache is None:
                    continue
                cache.holders.discard(session)
                if cache.holders:
                    kept += 1
                else:
                    free.append(cache)
                    self._drop(name)
        return free, kept

    def _drop(self, name: str) -> None:
        cache = self._caches.pop(name, None)
        if cache is not None and self._latest.get(cache.key) == name:
            del self._latest[cache.key]


def registry() -> CacheRegistry:
    """The process's :class:`CacheRegistry`."""
    return shared("gemini_explicit_caches", CacheRegistry)


class ExplicitCaches:
    """The explicit caches one Session's requests created or read: named, recorded, and released at close."""

    def __init__(self, session: str, tenant: str | None, http: "HttpTransport", stats: "SessionStats",
                 caches: CacheRegistry | None = None, *, backends: Sequence[Backend] = (),
                 jobs: "BackgroundJobs | None" = None) -> None:
        from agentkv._support.jobs import BackgroundJobs

        self._session, self._tenant, self._http, self._stats = session, tenant, http, stats
        self._backends = tuple(b for b in backends if b.explicit_cache)
        self.jobs = jobs if jobs is not None else BackgroundJobs()
        # what holds a cache in the registry: this object alone (two Sessions may share a session id)
        self._holder = secrets.token_hex(16)
        self._registry = caches or registry()
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._closed = False

    def client(self, inner: "CompletionClient", backends: Sequence[Backend] | None = None) -> "CompletionClient":
        """``inner``, or a :class:`CachingClient` over it when one of ``backends`` (default: this Session's) writes
        explicit caches."""
        explicit = self._backends if backends is None else tuple(b for b in backends if b.explicit_cache)
        return CachingClient(inner, self, explicit) if explicit else inner

    def pending(self) -> bool:
        """Whether close has caches to release."""
        return bool(self)

    # ----------------------------------------------------------------- a request

    def plan(self, backend: Backend, call: Mapping[str, Any]) -> Plan | None:
        """What ``call`` would cache (None: nothing marked, below the model's minimum, or litellm's helpers moved)."""
        try:
            return _plan(backend, call, self._tenant)
        except Exception as exc:  # litellm's helpers moved: the request goes whole, uncached
            emit("explicit_cache_unplanned", level="warning", backend=backend.label, error=type(exc).__name__,
                 session=self._session)
            return None

    def named(self, plan: Plan) -> OwnedCache | None:
        """The live cache ``plan`` reads (another of this tenant's Sessions may have created it), now held here."""
        cache = self._registry.acquire(plan.key, self._holder)
        if cache is not None:
            self._record(cache.name)
        return cache

    def create(self, plan: Plan) -> Machine[OwnedCache | None]:
        """Create ``plan``'s cache and hold it (None when Gemini refused it: the request goes uncached)."""
        body = {**plan.body, "displayName": _display_name()}
        answer = yield Call(self._http.request, self._http.arequest, ("POST", f"{_root(plan.backend)}/cachedContents"),
                            {"json": body, "timeout_s": _TIMEOUT_S, "headers": plan.headers}, captures=True)
        if isinstance(answer, Raised):
            self._not_created(plan, answer.error)
            return None
        return self._created(plan, answer.value)

    def missing(self, cache: OwnedCache, error: Exception) -> bool:
        """Whether ``error`` (or the error a stream's wraps) says ``cache`` is gone; if so it is forgotten (never
        named or deleted again)."""
        text = f"{error} {getattr(error, 'original_exception', '')}"
        if not names_missing_cache(getattr(error, "status_code", None), text):
            return False
        self._registry.forget(cache.name)
        with self._lock:
            self._held.discard(cache.name)
        emit("explicit_cache_missing", level="warning", backend=cache.backend.label, session=self._session)
        return True

    @property
    def closing(self) -> bool:
        """The Session closed while this holds caches (a warm that was in flight created one): delete them now."""
        return self._closed and bool(self)

    # ----------------------------------------------------------------- close

    def close(self) -> Machine[None]:
        """Release every cache this Session holds; delete those no other Session holds, pricing their storage
        (never raises)."""
        for cache in self._released():
            done = yield Call(self._http.request, self._http.arequest, ("DELETE", f"{_root(cache.backend)}/{cache.name}"),
                              {"timeout_s": _TIMEOUT_S, "headers": cache.headers}, captures=True)
            try:
                if isinstance(done, Raised):
                    self._delete_failed(cache, done.error)
                else:
                    self._deleted(cache, gone=False)
            except Exception as exc:  # its storage unpriced; the next caches are released all the same
                emit("explicit_cache_unpriced", level="warning", error=type(exc).__name__, session=self._session)

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._held)

    # ----------------------------------------------------------------- helpers

    def _record(self, name: str) -> None:
        with self._lock:
            self._held.add(name)

    def _created(self, plan: Plan, answer: Any) -> OwnedCache | None:
        name = answer.get("name") if isinstance(answer, Mapping) else None
        if not isinstance(name, str) or not name.startswith("cachedContents/") or len(name) > _MAX_NAME:
            emit("explicit_cache_not_created", level="warning", backend=plan.backend.label, error="unnamed",
                 session=self._session)
            return None
        expires_at = _expiry(answer.get("expireTime"))
        cache = OwnedCache(plan.backend, name, plan.key, _tokens(answer), time.monotonic(),
                           None if expires_at is None else max(0.0, expires_at - time.time()), expires_at,
                           plan.headers, {self._holder})
        self._registry.add(cache)
        self._record(name)
        emit("explicit_cache_created", backend=plan.backend.label, tokens=cache.tokens, session=self._session)
        return cache

    def _not_created(self, plan: Plan, error: Exception) -> None:
        emit("explicit_cache_not_created", level="warning", backend=plan.backend.label, error=type(error).__name__,
             status=getattr(error, "status_code", None), session=self._session)

    def _released(self) -> list[OwnedCache]:
        self._closed = True
        with self._lock:
            names, self._held = sorted(self._held), set()
        free, kept = self._registry.release(self._holder, names)
        if kept:
            emit("explicit_cache_kept", kept=kept, session=self._session)  # another Session still reads them
        return free

    def _deleted(self, cache: OwnedCache, *, gone: bool) -> None:
        _priced(self._stats, cache)
        emit("explicit_cache_deleted", backend=cache.backend.label, gone=gone, session=self._session)

    def _delete_failed(self, cache: OwnedCache, error: Exception) -> None:
        if getattr(error, "status_code", None) in (403, 404):  # gone already (expired, or deleted elsewhere)
            self._deleted(cache, gone=True)
            return
        emit("explicit_cache_delete_failed", level="warning", backend=cache.backend.label, error=type(error).__name__,
             session=self._session)  # it lapses at its TTL


class CachingClient:
    """A completion client whose requests to an explicit-cache Gemini backend read the Session's own cache:
    created (once per tenant and prefix in this process) and named by the Session, the request carrying only what
    follows it. A request whose cache is gone is sent again whole, and one that cannot be cached goes whole at once:
    litellm's context caching never runs for these backends."""

    def __init__(self, inner: "CompletionClient", caches: ExplicitCaches, backends: Sequence[Backend]) -> None:
        self.inner, self._caches, self._backends = inner, caches, tuple(backends)

    def completion(self, **call: Any) -> Any:
        backend = self._target(call)
        if backend is None:
            return self.inner.completion(**call)
        plan = self._caches.plan(backend, call)
        cache, created = (None, False) if plan is None else (self._caches.named(plan), False)
        if plan is not None and cache is None:
            cache, created = run(self._caches.create(plan), self._caches.jobs), True
        try:
            if plan is None or cache is None:
                return self.inner.completion(**gemini_unmarked(call))
            try:
                answer = self.inner.completion(**gemini_named(call, plan.tail, cache.name))
            except Exception as exc:
                if not self._caches.missing(cache, exc):
                    raise
                return self.inner.completion(**gemini_unmarked(call))
            if call.get("stream"):
                return ReopenedStream(answer, self._caches, cache, lambda: self.inner.completion(**gemini_unmarked(call)))
            return _with_cache_write(answer, cache.tokens) if created else answer
        finally:
            if self._caches.closing:
                run(self._caches.close(), self._caches.jobs)

    async def acompletion(self, **call: Any) -> Any:
        backend = self._target(call)
        if backend is None:
            return await self.inner.acompletion(**call)
        plan = self._caches.plan(backend, call)
        cache, created = (None, False) if plan is None else (self._caches.named(plan), False)
        if plan is not None and cache is None:
            cache, created = await arun(self._caches.create(plan), self._caches.jobs), True
        try:
            if plan is None or cache is None:
                return await self.inner.acompletion(**gemini_unmarked(call))
            try:
                answer = await self.inner.acompletion(**gemini_named(call, plan.tail, cache.name))
            except Exception as exc:
                if not self._caches.missing(cache, exc):
                    raise
                return await self.inner.acompletion(**gemini_unmarked(call))
            if call.get("stream"):
                return ReopenedStream(answer, self._caches, cache, lambda: self.inner.acompletion(**gemini_unmarked(call)))
            return _with_cache_write(answer, cache.tokens) if created else answer
        finally:
            if self._caches.closing:
                await arun(self._caches.close(), self._caches.jobs)

    def _target(self, call: Mapping[str, Any]) -> Backend | None:
        """The explicit-cache backend ``call`` is addressed to, if any."""
        for backend in self._backends:
            if call.get("model") == backend.model and (call.get("api_base") or None) == (backend.api_base or None):
                return backend
        return None


class ReopenedStream:
    """A stream reading an explicit cache. litellm sends a streamed request at its first read: when that read says
    the cache is gone, the request is sent again whole (``reopen()``: a stream, or for ``async for`` an awaitable of
    one) and that stream is read instead. Every other attribute is the wrapped stream's."""

    def __init__(self, stream: Any, caches: ExplicitCaches, cache: OwnedCache, reopen: Callable[[], Any]) -> None:
        self._stream, self._caches, self._cache, self._reopen = stream, caches, cache, reopen
        self._it: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __iter__(self) -> "ReopenedStream":
        return self

    def __next__(self) -> Any:
        if self._it is not None:
            return next(self._it)
        self._it = iter(self._stream)
        try:
            return next(self._it)
        except StopIteration:
            raise
        except Exception as exc:
            if not self._caches.missing(self._cache, exc):
                raise
            self._stream = self._reopen()
            self._it = iter(self._stream)
            return next(self._it)

    def __aiter__(self) -> "ReopenedStream":
        return self

    async def __anext__(self) -> Any:
        if self._it is not None:
            return await self._it.__anext__()
        self._it = self._stream.__aiter__()
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            if not self._caches.missing(self._cache, exc):
                raise
            self._stream = await self._reopen()
            self._it = self._stream.__aiter__()
            return await self._it.__anext__()


# ----------------------------------------------------------------- litellm's Gemini transformation


def _plan(backend: Backend, call: Mapping[str, Any], tenant: str | None) -> Plan | None:
    """What ``call`` caches, through litellm's own helpers (what its context caching would have created)."""
    from litellm.llms.vertex_ai.context_caching.transformation import (
        separate_cached_messages, transform_openai_messages_to_gemini_context_caching)
    from litellm.llms.vertex_ai.context_caching.vertex_ai_context_caching import (
        _context_caching_skip_reason, local_cache_obj)
    from litellm.llms.vertex_ai.gemini.vertex_and_google_ai_studio_gemini import VertexGeminiConfig

    served = backend.served_model
    cached, tail = separate_cached_messages(messages=list(call.get("messages") or []))
    if not cached:
        return None
    wanted = {k: call[k] for k in ("tools", "tool_choice") if call.get(k) is not None}
    params = VertexGeminiConfig().map_openai_params(non_default_params=wanted, optional_params={}, model=served,
                                                    drop_params=False)
    tools, choice = params.get("tools"), params.get("tool_choice")
    if _context_caching_skip_reason(cached, tools, served, served, "gemini") is not None:
        return None
    content = local_cache_obj.get_cache_key(messages=cached, tools=tools, tool_choice=choice, model=served)
    body = dict(transform_openai_messages_to_gemini_context_caching(
        model=served, messages=copy.deepcopy(cached), custom_llm_provider="gemini", cache_key="",
        vertex_project=None, vertex_location=None))
    body.pop("displayName", None)
    if tools:
        body["tools"] = tools
    if choice is not None:
        body["toolConfig"] = choice
    headers = _key_headers(call)
    scope = (_root(backend), hashlib.sha256(headers.get("x-goog-api-key", "").encode()).hexdigest()[:16], tenant)
    return Plan(backend, (scope, content), body, tuple(tail), headers)


def _key_headers(call: Mapping[str, Any]) -> dict[str, str]:
    """The API key ``call`` is sent with (an ``x-goog-api-key`` in its headers wins, as in litellm)."""
    key = call.get("api_key") or os.environ.get("GEMINI_API_KEY")
    extra = call.get("extra_headers")
    sent = [v for k, v in extra.items() if str(k).lower() == "x-goog-api-key"] if isinstance(extra, Mapping) else []
    key = sent[-1] if sent else key
    return {"x-goog-api-key": str(key)} if key else {}


def _display_name() -> str:
    """A fresh opaque ``displayName``: nothing about the tenant or the content, so no one finds the cache by it."""
    return f"agentkv-{secrets.token_hex(8)}"


def _root(backend: Backend) -> str:
    return (backend.api_base or "https://generativelanguage.googleapis.com/v1beta").rstrip("/")


def _tokens(answer: Mapping[str, Any]) -> int | None:
    usage = answer.get("usageMetadata")
    tokens = usage.get("totalTokenCount") if isinstance(usage, Mapping) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and 0 <= tokens < _MAX_TOKENS else None


def _expiry(value: Any) -> float | None:
    from litellm.llms.vertex_ai.context_caching.known_cached_contents import parse_expire_time

    return parse_expire_time(value) if isinstance(value, str) and len(value) <= 64 else None


def _with_cache_write(answer: Any, tokens: int | None) -> Any:
    """``answer`` with the cache its request created counted as litellm counts a cache it creates: in the prompt and
    as ``cache_creation_input_tokens``, so that cost and the cache's moves read it as before."""
    usage = answer.get("usage") if isinstance(answer, Mapping) else getattr(answer, "usage", None)
    if not tokens or usage is None:
        return answer
    try:
        if isinstance(usage, dict):
            usage.update(prompt_tokens=int(usage.get("prompt_tokens") or 0) + tokens,
                         total_tokens=int(usage.get("total_tokens") or 0) + tokens, cache_creation_input_tokens=tokens)
        else:
            usage.prompt_tokens = int(usage.prompt_tokens or 0) + tokens
            usage.total_tokens = int(usage.total_tokens or 0) + tokens
            usage.cache_creation_input_tokens = tokens
    except Exception as exc:  # an answer that cannot take it: its cache write goes unreported
        emit("explicit_cache_write_unreported", level="warning", error=type(exc).__name__)
    return answer


def _priced(stats: "SessionStats", cache: OwnedCache) -> None:
    """The deleted cache's storage, from its creation to now (at most its lifetime), into the cost and the warms'."""
    prices = loaded_prices(cache.backend)
    if prices is None or cache.tokens is None:
        return
    stored_s = time.monotonic() - cache.created_at
    if cache.lifetime_s is not None:
        stored_s = min(stored_s, cache.lifetime_s)
    storage = cache.tokens * prices.storage_per_hour * stored_s / 3600
    stats.add_usd("cost_usd", storage)
    stats.add_usd("warm_cost_usd", storage)


# ----------------------------------------------------------------- the strategy

# Gemini bills explicit caches' storage per token-hour, a price litellm's map does not hold: Google's published
# prices (ai.google.dev/gemini-api/docs/pricing, USD per 1M tokens per hour) for the models that have one.
_STORAGE_PER_MTOK_HOUR = {"gemini-2.5-pro": 4.50, "gemini-2.5-flash": 1.00, "gemini-2.5-flash-lite": 1.00,
                          "gemini-3-pro-preview": 4.50}


class GeminiApi(ManagedApi):
    """Gemini's strategy: with ``explicit_cache``, requests marked up to the conversation's last cache write, the
    caches' storage priced, and a per-Session :class:`ExplicitCaches`."""

    name = "gemini"

    def marked(self, backend: Backend, call: Mapping[str, Any], marks: Marks) -> dict[str, Any]:
        call = unsalted(call)
        if not backend.explicit_cache:
            return call
        return gemini_marked(call, cache_end=marks.cache_end, ttl=backend.cache_retention)

    def prices(self, backend: Backend) -> Prices | None:
        served = backend.model.split("/", 1)[-1]
        storage = _STORAGE_PER_MTOK_HOUR.get(served, 0.0) / 1e6 if backend.model.startswith("gemini/") else 0.0
        return prices_for(backend.model, storage_per_hour=storage)

    def cache_moves(self, backend: Backend, usage: Usage) -> bool:
        return explicit_cache_moves(usage) if backend.explicit_cache else True

    def session_part(self, backends: Sequence[Backend], context: SessionContext) -> "ExplicitCaches | None":
        if not any(b.explicit_cache for b in backends):
            return None
        return ExplicitCaches(context.session_id, context.tenant, context.http, context.stats, backends=backends,
                              jobs=context.jobs)


GEMINI = GeminiApi()
