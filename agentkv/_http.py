"""The one HTTP seam: JSON GET and POST (and text GET for ``/metrics``), sync and async, over pooled httpx clients.

Everything agentkv asks a server outside a completion (``GET /v1/models``, ``POST /tokenize``, ``GET /metrics``) goes
through an :class:`HttpTransport`. The default (:func:`default_http`) keeps one pooled
``httpx.Client`` per process and one ``httpx.AsyncClient`` per event loop; tests hand in
:class:`agentkv.testing.FakeHttp`, whose one handler serves the sync and the async path alike.

    http = default_http()
    models = http.get_json("http://127.0.0.1:8001/v1/models", timeout_s=3.0)
    answer = await http.apost_json("http://127.0.0.1:8001/tokenize", {"prompt": "hi"}, timeout_s=5.0)
"""

from __future__ import annotations

import asyncio
import re
import threading
import weakref
from typing import Any, Protocol, runtime_checkable

from agentkv._defaults import process_default

__all__ = ["HttpError", "HttpTransport", "HttpxTransport", "default_http", "redact_url"]


class HttpError(Exception):
    """A request got a non-2xx answer (``status_code`` set) or no answer at all (``status_code`` None)."""

    def __init__(self, message: str, *, status_code: int | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.timed_out = timed_out


@runtime_checkable
class HttpTransport(Protocol):
    """JSON over HTTP (and text for Prometheus' ``/metrics``). Every method returns the parsed body (the text,
    for ``get_text``) or raises :class:`HttpError`."""

    def get_json(self, url: str, *, timeout_s: float) -> Any: ...

    def get_text(self, url: str, *, timeout_s: float) -> str: ...

    async def aget_text(self, url: str, *, timeout_s: float) -> str: ...

    def post_json(self, url: str, body: Any, *, timeout_s: float) -> Any: ...

    async def aget_json(self, url: str, *, timeout_s: float) -> Any: ...

    async def apost_json(self, url: str, body: Any, *, timeout_s: float) -> Any: ...


class HttpxTransport:
    """:class:`HttpTransport` over httpx: one pooled sync client, one async client per event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: Any = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    def get_json(self, url: str, *, timeout_s: float) -> Any:
        return self._send(lambda c: c.get(url, timeout=timeout_s), url)

    def post_json(self, url: str, body: Any, *, timeout_s: float) -> Any:
        return self._send(lambda c: c.post(url, json=body, timeout=timeout_s), url)

    def get_text(self, url: str, *, timeout_s: float) -> str:
        return str(self._send(lambda c: c.get(url, timeout=timeout_s), url, _text))

    async def aget_text(self, url: str, *, timeout_s: float) -> str:
        return str(await self._asend(lambda c: c.get(url, timeout=timeout_s), url, _text))

    async def aget_json(self, url: str, *, timeout_s: float) -> Any:
        return await self._asend(lambda c: c.get(url, timeout=timeout_s), url)

    async def apost_json(self, url: str, body: Any, *, timeout_s: float) -> Any:
        return await self._asend(lambda c: c.post(url, json=body, timeout=timeout_s), url)

    def _send(self, call: Any, url: str, parse: Any = None) -> Any:
        import httpx

        try:
            return (parse or _parsed)(call(self._sync_client()), url)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, url) from exc

    async def _asend(self, call: Any, url: str, parse: Any = None) -> Any:
        import httpx

        try:
            return (parse or _parsed)(await call(self._async_client()), url)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, url) from exc

    def _sync_client(self) -> Any:
        with self._lock:
            if self._sync is None:
                import httpx

                self._sync = httpx.Client(limits=httpx.Limits(max_keepalive_connections=32))
            return self._sync

    def _async_client(self) -> Any:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                import httpx

                client = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=32))
                self._async[loop] = client
            return client


def _parsed(response: Any, url: str) -> Any:
    if response.status_code >= 400:
        raise HttpError(f"{response.status_code} from {_path(url)}", status_code=response.status_code)
    try:
        return response.json()
    except ValueError as exc:
        raise HttpError(f"non-JSON answer from {_path(url)}", status_code=response.status_code) from exc


def _text(response: Any, url: str) -> str:
    if response.status_code >= 400:
        raise HttpError(f"{response.status_code} from {_path(url)}", status_code=response.status_code)
    return str(response.text)


def _transport_error(exc: BaseException, url: str) -> HttpError:
    import httpx

    return HttpError(f"{type(exc).__name__} from {_path(url)}", timed_out=isinstance(exc, httpx.TimeoutException))


def _path(url: str) -> str:
    """The URL without credentials or query string (for messages and events: never a body, never a secret)."""
    return redact_url(url.split("?", 1)[0])


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^?#]*@")  # to the last '@': a raw '@' or '/' in a password


def redact_url(url: str) -> str:
    """``url`` without its ``user:password@`` (everything between ``scheme://`` and the last ``@`` before a query)."""
    head, mark, query = url.partition("?")
    return _USERINFO.sub(r"\1", head) + mark + query


default_http = process_default(HttpxTransport, "The process-wide pooled HTTP transport.")
