"""The one HTTP seam: one request method per mode, one error.

Everything agentkv asks a server outside a litellm completion goes through an :class:`HttpTransport`: the Session's
``GET /v1/models``, ``POST /tokenize``, ``GET /metrics``, its warm-ahead and export POSTs, and the gateway's relayed
requests. Two modes, each with the one error :class:`HttpError`:

- :meth:`HttpTransport.request` (and its async twin :meth:`~HttpTransport.arequest`): any method, a JSON body (or
  none), the answer parsed as JSON (``text=True``: as text, for ``/metrics``);
- :meth:`HttpTransport.post`: a raw POST whose answer is read as it arrives (a stream passed on chunk by chunk);
  :meth:`HttpTransport.start` writes one at once when the transport can.

Two implementations:

- :class:`HttpxTransport` (the default, :func:`default_http`): one pooled ``httpx.Client`` per process and one
  ``httpx.AsyncClient`` per event loop;
- :class:`agentkv.gateway.upstream.Upstream`: the gateway's lean HTTP/1.1 client for its relayed POSTs (a tenth of
  httpx's CPU per request), with its JSON requests served by an :class:`HttpxTransport` it holds;

and one fake, :class:`agentkv.testing.FakeHttp`, whose one handler serves the sync, the async and the raw path alike.

``timeout_s`` is a deadline for the whole call (connect, send, every byte of the answer), not a bound per
read: a server trickling its answer a byte at a time is cut off at ``timeout_s`` (``HttpError.kind == "timeout"``).
An answer is read in pieces and refused past ``max_answer_bytes`` (16 MiB by default; a ``/tokenize`` answer
for a million-token prompt is about 8 MiB), never held whole first (``kind == "too_large"``).

    http = default_http()
    models = http.request("GET", "http://127.0.0.1:8001/v1/models", timeout_s=3.0)
    answer = await http.arequest("POST", "http://127.0.0.1:8001/tokenize", json={"prompt": "hi"}, timeout_s=5.0)
"""

from __future__ import annotations

import asyncio
import re
import threading
import weakref
from typing import Any, AsyncIterator, Literal, Mapping, Protocol, runtime_checkable

from agentkv._support.defaults import process_default

__all__ = ["DEFAULT_MAX_ANSWER_BYTES", "HttpAnswer", "HttpError", "HttpErrorKind", "HttpTransport", "HttpxTransport",
           "StartedPost", "default_http", "redact_url", "unsendable_header"]

HttpErrorKind = Literal["outage", "timeout", "status", "too_large"]


class HttpError(Exception):
    """Every failure of the HTTP seam, by ``kind``:

    - ``"outage"``: no answer (refused, unreachable, the connection closed without or inside one);
    - ``"timeout"``: no whole answer within the call's deadline (or, for a raw POST, no byte for its read timeout);
    - ``"status"``: an answer, but not a usable one (``status_code`` >= 400, or a body that does not parse);
    - ``"too_large"``: an answer past the reader's bound.

    ``status_code``: the answer's status when one came (without a ``kind``, an error with one is of kind "status",
    one without of kind "outage"). ``reason``: how an outage or a timeout happened, when the transport knows it better
    than the error's cause chain says (:func:`agentkv.retry.outage_cause`'s words: "refused", "unreachable",
    "dropped", "incomplete"); httpx's own error, when there is one, is the ``__cause__``.

        raise HttpError("503 from http://10.0.0.5:8000/tokenize", status_code=503)       # kind "status"
        raise HttpError("no answer within 5 s", kind="timeout")
    """

    def __init__(self, message: str, *, kind: HttpErrorKind | None = None, status_code: int | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.kind: HttpErrorKind = kind or ("status" if status_code is not None else "outage")
        self.status_code = status_code
        self.reason = reason


class HttpAnswer(Protocol):
    """A raw POST's answer (:meth:`HttpTransport.post`): ``status_code``, ``headers`` (names lower-cased), and a body
    read once, whole or as it arrives (:class:`HttpError` when it breaks off; :class:`agentkv.errors.AnswerTooLarge`
    when :meth:`aread` passes its bound). Closing it before its end closes its connection (the backend aborts)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


class StartedPost(Protocol):
    """A raw POST already on the wire (:meth:`HttpTransport.start`): await its answer, or cancel it."""

    @property
    def url(self) -> str: ...

    @property
    def content(self) -> bytes: ...

    async def response(self) -> HttpAnswer: ...

    def cancel(self) -> None: ...


@runtime_checkable
class HttpTransport(Protocol):
    """The HTTP seam: a JSON (or text) request, sync and async, and a raw POST; every failure an :class:`HttpError`.

    :meth:`request` sends ``json`` (None: no body) with ``headers`` and returns the answer parsed (``text=True``: its
    text). :meth:`post` returns once a raw POST's answer headers are in, its body unread; :meth:`start` writes one at
    once when the transport can (None when it cannot: the caller then awaits :meth:`post`)."""

    def request(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                timeout_s: float, text: bool = False) -> Any: ...

    async def arequest(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                       timeout_s: float, text: bool = False) -> Any: ...

    async def post(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> HttpAnswer: ...

    def start(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> StartedPost | None: ...

    async def aclose(self) -> None: ...


DEFAULT_MAX_ANSWER_BYTES = 16 * 1024 * 1024


class HttpxTransport:
    """:class:`HttpTransport` over httpx: one pooled sync client, one async client per event loop.

    ``max_answer_bytes``: the largest JSON answer read (decoded); a larger one is an :class:`HttpError`.
    ``connect_timeout_s`` / ``read_timeout_s``: a raw :meth:`post`'s bounds (no byte for that long is a timeout), and
    ``max_raw_bytes`` the largest raw answer :meth:`HttpAnswer.aread` reads whole (a stream is passed on as it comes).
    """

    def __init__(self, *, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 600.0, max_raw_bytes: int = 64 << 20) -> None:
        self.max_answer_bytes = max_answer_bytes
        self.connect_timeout_s, self.read_timeout_s, self.max_raw_bytes = connect_timeout_s, read_timeout_s, max_raw_bytes
        self._lock = threading.Lock()
        self._sync: Any = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    def request(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                timeout_s: float, text: bool = False) -> Any:
        """``method`` ``url`` with the JSON body ``json`` (None: none): the answer parsed (its text with ``text``)."""
        return self._send(method, url, json, timeout_s, _text if text else None, headers=headers)

    async def arequest(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                       timeout_s: float, text: bool = False) -> Any:
        """:meth:`request` over this event loop's async client."""
        return await self._asend(method, url, json, timeout_s, _text if text else None, headers=headers)

    async def post(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> HttpAnswer:
        """POST ``content`` (JSON) to ``url``; returns once the answer's headers are in (its body unread)."""
        import httpx

        client = self._async_client()
        timeout = httpx.Timeout(self.read_timeout_s, connect=self.connect_timeout_s)
        request = client.build_request("POST", url, content=content, timeout=timeout,
                                       headers={**(headers or {}), "content-type": "application/json",
                                                "accept-encoding": "identity"})  # the raw bytes go on as they are
        try:
            return _HttpxAnswer(await client.send(request, stream=True), self.max_raw_bytes, url)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, url) from exc

    def start(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> StartedPost | None:
        """None: httpx writes a request only when its answer is awaited (:meth:`post`)."""
        return None

    async def aclose(self) -> None:
        """Close this event loop's async client (the next call on it opens another)."""
        with self._lock:
            client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def _send(self, method: str, url: str, body: Any, timeout_s: float, parse: Any = None, *,
              headers: Mapping[str, str] | None = None) -> Any:
        import httpx

        from agentkv.http.deadline import deadline

        client = self._sync_client()  # made (once) outside the call's deadline
        try:
            with deadline(timeout_s), client.stream(method, url, json=body, timeout=timeout_s,
                                                    headers=headers) as answer:
                content = _Capped(self.max_answer_bytes, url)
                for chunk in answer.iter_bytes():
                    content.add(chunk)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, url) from exc
        return (parse or _parsed)(_whole(answer, content.bytes()), url)

    async def _asend(self, method: str, url: str, body: Any, timeout_s: float, parse: Any = None, *,
                     headers: Mapping[str, str] | None = None) -> Any:
        import httpx

        client = self._async_client()

        async def call() -> Any:
            async with client.stream(method, url, json=body, timeout=timeout_s, headers=headers) as answer:
                content = _Capped(self.max_answer_bytes, url)
                async for chunk in answer.aiter_bytes():
                    content.add(chunk)
                return answer, content

        try:
            answer, content = await asyncio.wait_for(call(), timeout_s)
        except asyncio.TimeoutError as exc:
            raise HttpError(f"no whole answer within {timeout_s} s from {_path(url)}", kind="timeout") from exc
        except httpx.HTTPError as exc:
            raise _transport_error(exc, url) from exc
        return (parse or _parsed)(_whole(answer, content.bytes()), url)

    def _sync_client(self) -> Any:
        with self._lock:
            if self._sync is None:
                import httpx

                from agentkv.http.deadline import DeadlineTransport

                self._sync = httpx.Client(transport=DeadlineTransport(httpx.Limits(max_keepalive_connections=32)))
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


class _HttpxAnswer:
    """An httpx streamed response as an :class:`HttpAnswer` (httpx's errors raised as :class:`HttpError`)."""

    def __init__(self, response: Any, max_bytes: int, url: str) -> None:
        self._response, self._max_bytes, self._url = response, max_bytes, url
        self.status_code: int = response.status_code
        self.headers: dict[str, str] = {k.lower(): v for k, v in response.headers.items()}
        self._closing: Any = None

    async def aread(self) -> bytes:
        from agentkv.errors import AnswerTooLarge

        chunks, size = [], 0
        async for chunk in self.aiter_raw():
            size += len(chunk)
            if size > self._max_bytes:
                await self.aclose()
                raise AnswerTooLarge(self._max_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self._url) from exc

    async def aclose(self) -> None:
        await self._response.aclose()

    def close(self) -> None:
        """:meth:`aclose` for callers that cannot wait: run as a task on the running loop (kept until it is done; its
        failure is retrieved, never logged as unhandled). Without a running loop nothing can be awaited: the stream is
        left to its response's own cleanup."""
        if self._closing is not None or self._response.is_closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._closing = loop.create_task(self._response.aclose())
        self._closing.add_done_callback(_retrieved)


def _retrieved(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()  # a close that failed has nothing left to clean up


class _Capped:
    """An answer's (decoded) bytes, taken piece by piece: :class:`HttpError` as soon as they pass ``limit``."""

    def __init__(self, limit: int, url: str) -> None:
        self.limit, self.url, self.size = limit, url, 0
        self.parts: list[bytes] = []

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise HttpError(f"answer from {_path(self.url)} is larger than {self.limit} bytes; not read further",
                            kind="too_large")
        self.parts.append(chunk)

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def _whole(answer: Any, content: bytes) -> Any:
    """A response already read (``content`` decoded), for the parsers."""
    import httpx

    headers = [(k, v) for k, v in answer.headers.items() if k.lower() not in ("content-encoding", "content-length")]
    return httpx.Response(answer.status_code, headers=headers, content=content)


def _parsed(response: Any, url: str) -> Any:
    if response.status_code >= 400:
        raise HttpError(f"{response.status_code} from {_path(url)}", kind="status", status_code=response.status_code)
    try:
        return response.json()
    except (ValueError, RecursionError) as exc:
        raise HttpError(f"non-JSON answer from {_path(url)}", kind="status", status_code=response.status_code) from exc


def _text(response: Any, url: str) -> str:
    if response.status_code >= 400:
        raise HttpError(f"{response.status_code} from {_path(url)}", kind="status", status_code=response.status_code)
    return str(response.text)


def _transport_error(exc: BaseException, url: str) -> HttpError:
    import httpx

    return HttpError(f"{type(exc).__name__} from {_path(url)}",
                     kind="timeout" if isinstance(exc, httpx.TimeoutException) else "outage")


def _path(url: str) -> str:
    """The URL without credentials or query string (for messages and events: never a body, never a secret)."""
    return redact_url(url)


# to the last '@' before a query: a raw '@', '/' or '#' in a password
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^?]*@")


def redact_url(url: str) -> str:
    """``url`` as agentkv shows it (events, stats, spans, messages): without its ``user:password@`` (everything between
    ``scheme://`` and the last ``@`` before a query), its query string and its fragment, where a key may ride
    (``?api_key=…``). What is left, scheme, host, port and path, names a server without a secret."""
    return _USERINFO.sub(r"\1", url.split("?", 1)[0]).split("#", 1)[0]


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 field name
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e]*")  # printable ASCII and tabs: no CR, LF, NUL or non-ASCII


def unsendable_header(headers: Any) -> str | None:
    """The first of ``headers`` (a mapping of names to values) that no HTTP client can send, shown safely (its name
    escaped and cut to 64 characters, never its value); None when every one can be sent. A name must be an RFC 9110
    token and a string (or bytes) value printable ASCII (no CR, LF, NUL or non-ASCII characters); other values are
    the client's to judge."""
    if not isinstance(headers, Mapping):
        return None
    for name, value in headers.items():
        text = value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else value
        if not isinstance(name, str) or not _TOKEN.fullmatch(name) or (
                isinstance(text, str) and not _FIELD_VALUE.fullmatch(text)):
            return ascii(name)[1:-1][:64] if isinstance(name, str) else type(name).__name__
    return None


default_http = process_default(HttpxTransport, "The process-wide pooled HTTP transport.")
