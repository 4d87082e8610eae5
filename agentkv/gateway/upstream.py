"""The gateway's upstream seam: a lean HTTP/1.1 client for its two backends, on asyncio protocols and llhttp.

:class:`Upstream` is an :class:`agentkv.HttpTransport` (the one HTTP seam): its raw POSTs (:meth:`Upstream.post`,
:meth:`Upstream.start`, the relayed requests) are its own; its JSON calls (discovery, ``/tokenize``, warms) go to the
:class:`~agentkv.http.transport.HttpxTransport` it holds, so one object carries all of a gateway's HTTP.

One POST of a JSON body per request, over keep-alive connections pooled per origin; the answer's headers are
awaited, its body read whole (:meth:`UpstreamResponse.aread`) or passed on chunk by chunk as it arrives
(:meth:`UpstreamResponse.aiter_raw`, transfer-decoded, never buffered whole: reading pauses past
:data:`HIGH_WATER` bytes unread). A general client (httpx over httpcore) spends about half a millisecond of CPU
on each such request in auth, redirect, cookie and pool machinery; this one spends a tenth of that, which is
most of what the gateway adds to a small request.

Failures are raised as the seam's one error, :class:`~agentkv.http.transport.HttpError`, caused by the socket error
when there is one (:func:`agentkv.retry.outage_cause` reads both): ``kind="outage"`` when the connection cannot be made
(``reason="unreachable"``, or "refused" from its cause) or is closed before or inside an answer, or the answer does
not parse (``reason="dropped"``); ``kind="timeout"`` when connecting takes over ``connect_timeout_s``
(``reason="unreachable"``) or no byte comes for ``read_timeout_s``. A write to a connection the backend closed is not
an error of its own: the close arrives as the connection's loss, and is read as one of these.

A connection is reused only while it is idle for less than ``keepalive_s`` (below uvicorn's 5 s, so a backend
never closes one under a request) and has not been closed by the backend; a request whose reused connection
proves closed before any byte of its answer is sent once more on a new connection. Closing a response before
its end closes its connection, which is how a backend learns that the client left (vLLM aborts the request).

    upstream = Upstream(connect_timeout_s=5, read_timeout_s=600)
    response = await upstream.post("http://127.0.0.1:8001/v1/chat/completions", body)
    async for chunk in response.aiter_raw(): ...
    await upstream.aclose()
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Mapping
from urllib.parse import urlsplit

import httptools

from agentkv.http.transport import HttpError, HttpxTransport, redact_url
from agentkv.errors import AnswerTooLarge

__all__ = ["HIGH_WATER", "Started", "Upstream", "UpstreamResponse"]

HIGH_WATER = 1 << 20
"""Unread answer bytes at which a connection stops reading (resumed below a quarter of it)."""
MAX_HEADER_BYTES = 64 << 10
"""The most header bytes an answer may have."""
_Origin = tuple[str, str, int]  # (scheme, host, port)


class Upstream:
    """Keep-alive HTTP/1.1 connections to the backends, and one POST per call (see the module).

    ``max_idle``: idle connections kept per origin; ``max_answer_bytes``: the largest body :meth:`~UpstreamResponse.aread`
    reads whole (a stream is not bounded here: it is passed on as it comes)."""

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0, keepalive_s: float = 4.0,
                 max_idle: int = 512, max_answer_bytes: int = 64 << 20, json: HttpxTransport | None = None) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.json = json or HttpxTransport(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        self.keepalive_s, self.max_idle, self.max_answer_bytes = keepalive_s, max_idle, max_answer_bytes
        self._idle: dict[_Origin, deque[_Connection]] = {}
        self._targets: dict[str, tuple[_Origin, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._open: set[_Connection] = set()
        self.opened = 0  # connections made, for tests and metrics

    # JSON requests: the held httpx transport's (the relay's hot path is the raw POST below)
    def request(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                timeout_s: float, text: bool = False) -> Any:
        return self.json.request(method, url, json=json, headers=headers, timeout_s=timeout_s, text=text)

    async def arequest(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                       timeout_s: float, text: bool = False) -> Any:
        return await self.json.arequest(method, url, json=json, headers=headers, timeout_s=timeout_s, text=text)

    async def post(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """POST ``content`` (JSON) to ``url`` with ``headers`` besides the gateway's own; returns once the answer's
        headers are in (its body unread)."""
        started = self.start(url, content, headers)
        if started is not None:
            return await started.response()
        return await self._post_new(url, content, headers)

    def start(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> Started | None:
        """POST ``content`` to ``url`` now, on an idle kept connection, without waiting (None when none is idle):
        the request is on the wire when this returns; :meth:`Started.response` awaits the answer's headers."""
        origin, head = self._target(url)
        connection = self._reusable(origin)
        if connection is None:
            return None
        return Started(self, url, content, connection, connection.begin(_request(head, content, headers), self),
                       headers)

    async def _post_new(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        origin, head = self._target(url)
        connection = await self._connect(origin)
        try:
            return await connection.answer(connection.begin(_request(head, content, headers), self), self)
        except _ClosedBeforeAnswer as closed:
            raise _dropped("the backend closed the connection without an answer", closed.cause) from closed.cause

    def _target(self, url: str) -> tuple[_Origin, bytes]:
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise HttpError(f"not an http(s) URL: {redact_url(url)!r}", kind="outage", reason="unreachable")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.netloc.rsplit("@", 1)[-1]
            head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Accept: */*\r\nAccept-Encoding: identity\r\nUser-Agent: agentkv-gateway\r\n").encode("latin-1")
            known = self._targets[url] = ((parts.scheme, parts.hostname, port), head)
        return known

    def _reusable(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used first
            if connection.reusable(now, self.keepalive_s):
                return connection
            connection.close()
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        context = self._ssl_context() if scheme == "https" else None
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(origin), host, port, ssl=context,
                                       server_hostname=host if context else None),
                self.connect_timeout_s)
        except asyncio.TimeoutError as timeout:
            raise HttpError(f"connecting to {host}:{port} took over {self.connect_timeout_s} s", kind="timeout",
                            reason="unreachable") from timeout
        except OSError as error:
            raise HttpError(f"cannot connect to {host}:{port} ({type(error).__name__})", kind="outage",
                            reason="unreachable") from error
        self.opened += 1
        connection.owner = self
        self._open.add(connection)
        return connection

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _release(self, connection: _Connection) -> None:
        """A connection whose answer was read to its end: kept for the next request, or closed."""
        idle = self._idle.setdefault(connection.origin, deque())
        if connection.keep_alive and len(idle) < self.max_idle:
            connection.idle_since = time.monotonic()
            idle.append(connection)
        else:
            connection.close()

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)

    async def aclose(self) -> None:
        """Close every connection, idle or in use (and the JSON transport's on this loop)."""
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await self.json.aclose()


class Started:
    """A request already written on a kept connection (:meth:`Upstream.start`): await :meth:`response`, or
    :meth:`cancel` it (its connection is closed, so the backend aborts it)."""

    def __init__(self, client: Upstream, url: str, content: bytes, connection: _Connection,
                 head: asyncio.Future[UpstreamResponse], headers: Mapping[str, str] | None = None) -> None:
        self._client, self.url, self.content, self.headers = client, url, content, headers
        self._connection, self._head = connection, head

    async def response(self) -> UpstreamResponse:
        """The answer's headers; a kept connection found closed before any byte of its answer is replaced by a
        new one and the request sent once more."""
        try:
            return await self._connection.answer(self._head, self._client)
        except _ClosedBeforeAnswer:
            return await self._client._post_new(self.url, self.content, self.headers)

    def cancel(self) -> None:
        """Abandon the request: its connection is closed (an answer that came is dropped)."""
        if not self._head.done():
            self._head.cancel()
        self._connection.close()


class UpstreamResponse:
    """A backend's answer: ``status_code``, ``headers`` (names lower-cased) and a body read once."""

    def __init__(self, connection: _Connection, status_code: int, headers: dict[str, str]) -> None:
        self._connection = connection
        self.status_code = status_code
        self.headers = headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (transfer-decoded); the connection goes back to the pool at its end."""
        connection = self._connection
        while True:
            chunk = await connection.next_chunk()
            if chunk is None:
                return
            yield chunk

    async def aread(self) -> bytes:
        """The whole body (:class:`~agentkv.errors.AnswerTooLarge` past the client's ``max_answer_bytes``)."""
        whole = self._connection.whole()
        if whole is not None:  # it came with the headers (a short answer): no waiting, one join
            return whole
        chunks, size, limit = [], 0, self._connection.client_limit
        async for chunk in self.aiter_raw():
            size += len(chunk)
            if size > limit:
                self._connection.close()
                raise AnswerTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        """Done with the answer: a body not read to its end closes the connection (the backend aborts)."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose`, which never waits, for callers that cannot."""
        self._connection.finish()


class _ClosedBeforeAnswer(Exception):
    def __init__(self, cause: BaseException | None) -> None:
        super().__init__("closed before any byte of the answer")
        self.cause = cause


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one exchange at a time, its answer parsed by llhttp as bytes arrive."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.keep_alive = False
        self.idle_since = 0.0
        self.client_limit = 0
        self.owner: Upstream | None = None  # the client that made it
        self._client: Upstream | None = None  # the client while an exchange is under way
        self._lost = False
        self._lost_cause: BaseException | None = None
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._received = False
        self._framed = False  # the answer says where it ends (a length or chunks), not the connection's close

    # ------------------------------------------------------------------ the exchange, from the client's side

    def reusable(self, now: float, keepalive_s: float) -> bool:
        return not self._lost and self.transport is not None and not self.transport.is_closing() \
            and now - self.idle_since < keepalive_s

    def begin(self, request: bytes, client: Upstream) -> asyncio.Future[UpstreamResponse]:
        """Write ``request``; the future of its answer's headers (see :meth:`answer`)."""
        self._reset()
        self._client, self.client_limit = client, client.max_answer_bytes
        head = self._head = asyncio.get_running_loop().create_future()
        if self._lost or self.transport is None:
            head.set_exception(_ClosedBeforeAnswer(self._lost_cause))
        else:
            self.transport.write(request)
        return head

    async def answer(self, head: asyncio.Future[UpstreamResponse], client: Upstream) -> UpstreamResponse:
        """The answer once its headers are in (an :class:`HttpError` of kind "timeout" after the client's read
        timeout)."""
        timer = asyncio.get_running_loop().call_later(client.read_timeout_s, self._timed_out, head)
        try:
            return await head
        except BaseException:
            self.close()  # a timeout, a bad answer, a cancelled caller: the backend is told by the close
            raise
        finally:
            timer.cancel()

    def whole(self) -> bytes | None:
        """The whole body, when all of it is in and within the client's limit (the exchange is then finished);
        else None, and nothing is taken."""
        if not self._done or self._failure is not None or self._buffered > self.client_limit:
            return None
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:  # the read that paused it ended the answer
            self._paused = False
            self.transport.resume_reading()
        self.finish()
        return body

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end."""
        while not self._chunks:
            if self._failure is not None:
                raise self._failure
            if self._done:
                self.finish()
                return None
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            assert self._client is not None
            timer = loop.call_later(self._client.read_timeout_s, self._timed_out, waiter)
            try:
                await waiter
            except BaseException:
                self.close()
                raise
            finally:
                timer.cancel()
                self._waiter = None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < HIGH_WATER // 4 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def finish(self) -> None:
        """The client is done with this exchange: back to the pool after a complete answer, else closed."""
        client, self._client = self._client, None
        if client is None:
            return
        if self._done and not self._chunks and self._failure is None and not self._lost:
            client._release(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.keep_alive = False

    def _timed_out(self, waiting: asyncio.Future[Any]) -> None:
        if not waiting.done():
            waiting.set_exception(HttpError("the backend sent nothing for the read timeout", kind="timeout"))

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (asyncio's or uvloop's)

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as bad:
            self._fail(_dropped(f"the backend's answer does not parse ({type(bad).__name__})", None))
            self.close()
            return
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost, self._lost_cause = True, exc
        if self._client is None:  # idle in the pool: dropped when next taken
            self._forget()
            return
        head = self._head
        if head is not None and not head.done():
            if not self._received:
                head.set_exception(_ClosedBeforeAnswer(exc))
            else:
                self._fail(_dropped("the backend closed the connection inside its answer's headers", exc))
        elif not self._done:
            if self._framed:
                self._fail(_dropped("the backend closed the connection inside its answer", exc))
            else:
                self._done = True  # an answer delimited by the connection's close ends here
                self._wake()
        self._forget()

    def _forget(self) -> None:
        if self.owner is not None:
            self.owner._forget(self)

    # ------------------------------------------------------------------ llhttp's callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise httptools.HttpParserError("headers too large")
        key = name.decode("latin-1").lower()
        if key in ("content-length", "transfer-encoding"):
            self._framed = True
        self._headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.keep_alive = self._parser.should_keep_alive()
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers, self._header_bytes = {}, 0
            return
        if status in (204, 304):
            self._framed = True
        head = self._head
        if head is not None and not head.done():
            head.set_result(UpstreamResponse(self, status, self._headers))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if 100 <= self._parser.get_status_code() < 200:
            return
        self._done = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _dropped(message: str, cause: BaseException | None) -> HttpError:
    """The connection closed without a whole answer, or the answer does not parse: an outage, caused by ``cause``."""
    error = HttpError(message, kind="outage", reason="dropped")
    error.__cause__ = cause
    return error


def _request(head: bytes, content: bytes, headers: Mapping[str, str] | None = None) -> bytes:
    """A POST's bytes: the target's request line and headers, the caller's ``headers`` (names and values with no
    CR, LF or NUL: anything else is refused, never sent), its length, its JSON body."""
    extra = b"".join(b"%s: %s\r\n" % (_header_bytes(name), _header_bytes(value))
                     for name, value in headers.items()) if headers else b""
    return b"%s%sContent-Length: %d\r\n\r\n%s" % (head, extra, len(content), content)


def _header_bytes(text: str) -> bytes:
    if not isinstance(text, str) or any(c in text for c in "\r\n\0"):
        raise ValueError(f"a header name or value holds a line break or NUL: {text[:40]!r}")
    return text.encode("latin-1")
