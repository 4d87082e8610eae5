"""Backends and their context windows: declared, discovered from the server, or from litellm's catalog.

Discovered windows and served model ids live in a thread-safe ``TTLCache`` (15 minutes by default,
keyed by ``(api_base, model)``) so that a swap slot which loads another model is read again.

Usage::

    fast = Backend("hosted_vllm/qwen3-8b", api_base="http://127.0.0.1:8001/v1")
    info = default_discovery().window(fast)      # WindowInfo(window=32768, source="server", ...)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cachetools import TTLCache

from agentkv._defaults import process_default
from agentkv.errors import ConfigurationError
from agentkv.events import emit

DEFAULT_WINDOW_TTL_S = 900.0


@dataclass(frozen=True)
class Backend:
    """One model endpoint.

    ``model`` is a litellm model string (``"hosted_vllm/qwen3-8b"``); ``window`` declares the context
    window (otherwise it is discovered); ``tokenizer`` (a tiktoken encoding name, a transformers
    tokenizer, or a local tokenizer path) with ``chat_template`` makes token counts exact;
    ``completion_kwargs`` are extra litellm kwargs sent with every request to this backend.

        Backend("hosted_vllm/qwen3-32b", api_base="http://127.0.0.1:8002/v1", window=131072)
    """

    model: str
    api_base: str | None = None
    api_key: str | None = None
    name: str | None = None
    window: int | None = None
    tokenizer: Any = None
    chat_template: str | None = None
    completion_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigurationError(f"Backend.model must be a non-empty litellm model string, got {self.model!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ConfigurationError(f"Backend.window must be a positive int, got {self.window!r}")
        if self.api_base is not None and not str(self.api_base).startswith(("http://", "https://")):
            raise ConfigurationError(f"Backend.api_base must be an http(s) URL, got {self.api_base!r}")

    @property
    def label(self) -> str:
        """The name used in decisions, logs and stats."""
        return self.name or self.model

    @property
    def served_model(self) -> str:
        """The model id the server knows: the litellm string without its provider prefix."""
        return self.model.split("/", 1)[1] if "/" in self.model else self.model

    @property
    def server_root(self) -> str | None:
        """The server root (``api_base`` without ``/v1``), where vLLM serves ``/tokenize``."""
        if not self.api_base:
            return None
        base = self.api_base.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def is_cloud(self) -> bool:
        """A litellm provider model with no ``api_base``: it must be in litellm's catalog."""
        return self.api_base is None

    def litellm_kwargs(self) -> dict[str, Any]:
        """The kwargs that address this backend in a litellm call."""
        kwargs: dict[str, Any] = {"model": self.model, **dict(self.completion_kwargs)}
        if self.api_base:
            kwargs["api_base"] = self.api_base
        if self.api_key:
            kwargs["api_key"] = self.api_key
        return kwargs


@dataclass(frozen=True)
class ServerInfo:
    """What ``GET /models`` said: the window of the configured model and the ids being served."""

    window: int | None
    served_ids: frozenset[str]
    model_listed: bool


@dataclass(frozen=True)
class WindowInfo:
    """A backend's window and where it came from: declared, server, catalog, corrected or unknown."""

    window: int | None
    source: str
    model_known: bool | None = None


def parse_models_response(payload: Any, served_model: str) -> ServerInfo:
    """Read ``max_model_len`` (or a proxy's ``max_input_tokens``) for ``served_model`` out of /models."""
    entries = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError("/models response has no 'data' list")
    ids = frozenset(str(e.get("id")) for e in entries if isinstance(e, Mapping) and e.get("id"))
    for entry in entries:
        if isinstance(entry, Mapping) and entry.get("id") == served_model:
            window = entry.get("max_model_len") or entry.get("max_input_tokens")
            return ServerInfo(int(window) if window else None, ids, True)
    return ServerInfo(None, ids, False)


_CATALOG: dict[str, int] = {}


def catalog_window(model: str) -> int | None:
    """litellm's ``max_input_tokens`` for ``model`` (not ``max_tokens``, the output cap), or None.

    Found windows are remembered; misses are asked again, so a later ``litellm.register_model`` counts.
    """
    if model in _CATALOG:
        return _CATALOG[model]
    from agentkv._env import import_litellm

    try:
        info = import_litellm().get_model_info(model)
    except Exception:  # litellm raises a bare Exception for unmapped models
        return None
    window = info.get("max_input_tokens") if isinstance(info, Mapping) else None
    if window:
        _CATALOG[model] = int(window)
    return int(window) if window else None


class WindowDiscovery:
    """Discovers windows and served model ids, caching them per ``(api_base, model)`` with a TTL.

    ``timer`` drives the TTL (inject a fake clock in tests); ``http_get`` is ``url -> parsed JSON``
    and defaults to httpx with a short timeout. Failures fall back to the next source with a logged
    reason and are never raised.
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_WINDOW_TTL_S,
        *,
        timer: Callable[[], float] = time.monotonic,
        http_get: Callable[[str], Any] | None = None,
        timeout_s: float = 3.0,
        maxsize: int = 1024,
    ) -> None:
        self._cache: TTLCache[tuple[str, str], ServerInfo | None] = TTLCache(maxsize, ttl_s, timer=timer)
        self._last_seen: dict[tuple[str, str], int | None] = {}
        self._corrections: TTLCache[tuple[str, str], int] = TTLCache(maxsize, ttl_s, timer=timer)
        self._lock = threading.Lock()
        self._http_get = http_get or _httpx_getter(timeout_s)

    def window(self, backend: Backend) -> WindowInfo:
        """The backend's window: declared, then server, then litellm's catalog."""
        if backend.window is not None:
            return WindowInfo(backend.window, "declared")
        key = _key(backend)
        with self._lock:
            corrected = self._corrections.get(key)
        if corrected is not None:
            return WindowInfo(corrected, "corrected", self._model_known(backend))
        info = self.server_info(backend)
        if info is not None and info.window is not None:
            return WindowInfo(info.window, "server", info.model_listed)
        window = catalog_window(backend.model)
        emit("window_fallback", level="warning", backend=backend.label, source="catalog" if window else "unknown")
        return WindowInfo(window, "catalog" if window else "unknown", self._model_known(backend))

    def served_model_known(self, backend: Backend) -> bool:
        """True only when the server lists the configured model (cloud backends: catalog knows it)."""
        return bool(self._model_known(backend))

    def _model_known(self, backend: Backend) -> bool | None:
        if backend.is_cloud:
            return catalog_window(backend.model) is not None
        info = self.server_info(backend)
        return None if info is None else info.model_listed

    def server_info(self, backend: Backend) -> ServerInfo | None:
        """The cached or freshly fetched ``/models`` answer, or None when the server gave none."""
        if backend.api_base is None:
            return None
        key = _key(backend)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        info = self._fetch(backend)
        self._store(key, backend, info)
        return info

    def _fetch(self, backend: Backend) -> ServerInfo | None:
        url = f"{backend.api_base.rstrip('/')}/models"
        try:
            return parse_models_response(self._http_get(url), backend.served_model)
        except Exception as exc:  # discovery must never break a request
            emit("discovery_failed", level="warning", backend=backend.label, url=url, reason=_reason(exc))
            return None

    def _store(self, key: tuple[str, str], backend: Backend, info: ServerInfo | None) -> None:
        with self._lock:
            self._cache[key] = info
            new = info.window if info else None
            old = self._last_seen.get(key)
            self._last_seen[key] = new
        if old is not None and new is not None and old != new:
            emit("window_changed", level="warning", backend=backend.label, old=old, new=new)

    def correct(self, backend: Backend, window: int) -> None:
        """Record the window a server reported in an overflow error when it disagrees with ours."""
        known = self.window(backend).window
        if known == window:
            return
        emit("window_stale", level="warning", backend=backend.label, cached=known, server=window)
        with self._lock:
            self._corrections[_key(backend)] = window

    def invalidate(self, backend: Backend | None = None) -> None:
        """Forget one backend's cached answers, or all of them."""
        with self._lock:
            if backend is None:
                self._cache.clear()
                self._corrections.clear()
            else:
                self._cache.pop(_key(backend), None)
                self._corrections.pop(_key(backend), None)

    async def aprefetch(self, backend: Backend, *, timeout_s: float = 3.0) -> None:
        """Fill the cache for ``backend`` over async HTTP, so the async path never blocks on discovery."""
        if backend.api_base is None or backend.window is not None:
            return
        with self._lock:
            if _key(backend) in self._cache:
                return
        import httpx

        url = f"{backend.api_base.rstrip('/')}/models"
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                response = await client.get(url)
                response.raise_for_status()
                info: ServerInfo | None = parse_models_response(response.json(), backend.served_model)
        except Exception as exc:  # discovery must never break a request
            emit("discovery_failed", level="warning", backend=backend.label, url=url, reason=_reason(exc))
            info = None
        self._store(_key(backend), backend, info)


def _key(backend: Backend) -> tuple[str, str]:
    return (backend.api_base or "", backend.model)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _httpx_getter(timeout_s: float) -> Callable[[str], Any]:
    def get(url: str) -> Any:
        import httpx

        response = httpx.get(url, timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    return get


default_discovery = process_default(
    WindowDiscovery, "The process-wide discovery cache that Sessions share unless given their own.")

