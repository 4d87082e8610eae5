"""The Gemini explicit caches a Session's warms created (through litellm's context caching), deleted when the
Session closes: a cache is billed per token-hour until it is deleted or its TTL lapses.

litellm creates the cache inside the warm's request and names it by a digest of the cached messages, tools and
model (its ``displayName``); the same digest, computed here with litellm's own helpers, finds it again in the
provider's list. Deletion runs in the background (a close never waits) and its storage is priced into the stats.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import quote

from agentkv.backends import Backend
from agentkv.costs import loaded_prices
from agentkv.events import emit

if TYPE_CHECKING:
    from agentkv._http import HttpTransport
    from agentkv.stats import SessionStats

__all__ = ["CreatedCache", "ExplicitCaches", "display_name"]

_LIST_PAGES = 20  # at most this many pages of the provider's cache list are read at close
_TIMEOUT_S = 5.0


def display_name(backend: Backend, call: Mapping[str, Any]) -> str | None:
    """The ``displayName`` litellm gives the explicit cache of ``call``'s marked messages (None: nothing marked)."""
    from litellm.llms.vertex_ai.context_caching.transformation import separate_cached_messages
    from litellm.llms.vertex_ai.context_caching.vertex_ai_context_caching import local_cache_obj
    from litellm.llms.vertex_ai.gemini.vertex_and_google_ai_studio_gemini import VertexGeminiConfig

    cached, _ = separate_cached_messages(messages=list(call.get("messages") or []))
    if not cached:
        return None
    wanted = {k: call[k] for k in ("tools", "tool_choice") if call.get(k) is not None}
    params = VertexGeminiConfig().map_openai_params(non_default_params=wanted, optional_params={},
                                                    model=backend.served_model, drop_params=False)
    return str(local_cache_obj.get_cache_key(messages=cached, tools=params.get("tools"),
                                             tool_choice=params.get("tool_choice"), model=backend.served_model))


@dataclass(frozen=True)
class CreatedCache:
    """One explicit cache a warm created: where it lives, its ``displayName``, and when (``time.monotonic``)."""

    backend: Backend
    name: str
    created_at: float


class ExplicitCaches:
    """The explicit caches this Session created; :meth:`delete` removes them from the provider."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._created: dict[tuple[str, str], CreatedCache] = {}

    def remember(self, backend: Backend, call: Mapping[str, Any], created_at: float | None = None) -> None:
        """Note the cache a request sent as ``call`` (litellm kwargs) created at ``created_at`` (``time.monotonic``;
        None: now), unless noted already."""
        name = display_name(backend, call)
        if name is not None:
            at = time.monotonic() if created_at is None else created_at
            with self._lock:
                self._created.setdefault((backend.api_base or "", name), CreatedCache(backend, name, at))

    def absorb(self, created: "collections.deque[tuple[Backend, Mapping[str, Any], float]]") -> None:
        """Note the caches the warms created (their backend, call and time), emptying ``created``; never raises."""
        while created:
            backend, call, at = created.popleft()
            try:
                self.remember(backend, call, at)
            except Exception as exc:  # litellm's helpers moved: the cache lapses at its TTL instead
                emit("explicit_cache_unnamed", level="warning", backend=backend.label, error=type(exc).__name__)

    def take(self) -> list[CreatedCache]:
        with self._lock:
            taken, self._created = list(self._created.values()), {}
        return taken

    def delete(self, http: "HttpTransport", stats: "SessionStats", session: str) -> None:
        """Delete every noted cache found in the provider's list, pricing each one's storage (never raises). Only
        caches this Session's requests created are noted (their answers reported the write): one it merely read,
        another Session's, is left alone."""
        for cache in self.take():
            try:
                found = _listed(http, cache)
                for entry in found:
                    http.call_json("DELETE", f"{_root(cache.backend)}/{entry['name']}", timeout_s=_TIMEOUT_S,
                                   headers=_headers(cache.backend))
                    _priced(stats, cache, entry)
                emit("explicit_cache_deleted", backend=cache.backend.label, found=len(found), session=session)
            except Exception as exc:  # a cache left behind lapses at its TTL
                emit("explicit_cache_delete_failed", level="warning", backend=cache.backend.label,
                     error=type(exc).__name__, session=session)


    async def adelete(self, http: "HttpTransport", stats: "SessionStats", session: str) -> None:
        """The async twin of :meth:`delete`."""
        for cache in self.take():
            try:
                found = await _alisted(http, cache)
                for entry in found:
                    await http.acall_json("DELETE", f"{_root(cache.backend)}/{entry['name']}", timeout_s=_TIMEOUT_S,
                                          headers=_headers(cache.backend))
                    _priced(stats, cache, entry)
                emit("explicit_cache_deleted", backend=cache.backend.label, found=len(found), session=session)
            except Exception as exc:  # a cache left behind lapses at its TTL
                emit("explicit_cache_delete_failed", level="warning", backend=cache.backend.label,
                     error=type(exc).__name__, session=session)

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._created)


def _root(backend: Backend) -> str:
    return (backend.api_base or "https://generativelanguage.googleapis.com/v1beta").rstrip("/")


def _headers(backend: Backend) -> dict[str, str]:
    import os

    key = backend.api_key or os.environ.get("GEMINI_API_KEY")
    return {"x-goog-api-key": key} if key else {}


def _page_url(cache: CreatedCache, token: str) -> str:
    return f"{_root(cache.backend)}/cachedContents?pageSize=100" + (f"&pageToken={quote(token, safe='')}" if token else "")


def _read_page(page: Any, cache: CreatedCache, found: list[Mapping[str, Any]]) -> str:
    """Add ``page``'s caches named ``cache.name`` to ``found``; the next page's token ("" when none)."""
    entries = page.get("cachedContents") if isinstance(page, Mapping) else None
    found += [e for e in entries or [] if isinstance(e, Mapping) and e.get("displayName") == cache.name
              and isinstance(e.get("name"), str) and e["name"].startswith("cachedContents/")]
    token = page.get("nextPageToken") if isinstance(page, Mapping) else None
    return token if isinstance(token, str) else ""


def _listed(http: "HttpTransport", cache: CreatedCache) -> list[Mapping[str, Any]]:
    """The provider's caches named ``cache.name`` (the list read page by page, bounded)."""
    found: list[Mapping[str, Any]] = []
    token = ""
    for _ in range(_LIST_PAGES):
        page = http.call_json("GET", _page_url(cache, token), timeout_s=_TIMEOUT_S, headers=_headers(cache.backend))
        token = _read_page(page, cache, found)
        if not token:
            break
    return found


async def _alisted(http: "HttpTransport", cache: CreatedCache) -> list[Mapping[str, Any]]:
    """The async twin of :func:`_listed`."""
    found: list[Mapping[str, Any]] = []
    token = ""
    for _ in range(_LIST_PAGES):
        page = await http.acall_json("GET", _page_url(cache, token), timeout_s=_TIMEOUT_S,
                                     headers=_headers(cache.backend))
        token = _read_page(page, cache, found)
        if not token:
            break
    return found


def _priced(stats: "SessionStats", cache: CreatedCache, entry: Mapping[str, Any]) -> None:
    """The deleted cache's storage, from its creation to now, into the Session's and the warms' cost."""
    prices = loaded_prices(cache.backend)
    usage = entry.get("usageMetadata")
    tokens = usage.get("totalTokenCount") if isinstance(usage, Mapping) else None
    if prices is None or not isinstance(tokens, int):
        return
    storage = tokens * prices.storage_per_hour * (time.monotonic() - cache.created_at) / 3600
    stats.add_usd("cost_usd", storage)
    stats.add_usd("warm_cost_usd", storage)
