"""A total deadline for the HTTP seam's sync calls.

httpx's timeouts bound each connect, read and write, not a call: a server that drips one byte at a time
holds a call for as long as it likes. :class:`DeadlineTransport` is httpx's sync transport over an httpcore
pool whose sockets bound every operation by what is left of the call's deadline, set with :func:`deadline`
around the call; past it, the next socket operation raises httpx's timeout. The async calls need none of
this: ``asyncio.wait_for`` bounds them whole.

    with deadline(2.0):
        client.get(url, timeout=2.0)   # 2 s in all, however the server trickles its answer
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
import time
from typing import Any, Iterable, Iterator

import httpcore
import httpx

__all__ = ["DeadlineTransport", "deadline"]

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("agentkv_http_deadline", default=None)


@contextlib.contextmanager
def deadline(timeout_s: float) -> Iterator[None]:
    """Bound every socket operation of the calls made in this block (on this thread) to ``timeout_s`` in all."""
    token = _DEADLINE.set(time.monotonic() + timeout_s)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    """``timeout`` cut to what is left of the deadline; ``error`` when nothing is."""
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the call's total deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout), local_address,
                                               socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout),
                                                       socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# httpcore's errors as httpx raises them (none of these is a superclass of another)
_ERRORS: dict[type[Exception], type[Exception]] = {
    httpcore.ConnectTimeout: httpx.ConnectTimeout, httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout, httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.ConnectError: httpx.ConnectError, httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError, httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError, httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProxyError: httpx.ProxyError,
}


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    try:
        yield
    except tuple(_ERRORS) as exc:
        raise next(to for frm, to in _ERRORS.items() if isinstance(exc, frm))(str(exc)) from exc


class _Body(httpx.SyncByteStream):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self._inner

    def close(self) -> None:
        with _as_httpx():
            self._inner.close()


class DeadlineTransport(httpx.BaseTransport):
    """httpx's sync transport (plain and TLS connections, a keep-alive pool) whose every socket operation stops at
    the deadline of the enclosing :func:`deadline` block."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(), max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        url = httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                           target=request.url.raw_path)
        core = httpcore.Request(method=request.method, url=url, headers=request.headers.raw, content=request.stream,
                                extensions=request.extensions)
        with _as_httpx():
            answer = self._pool.handle_request(core)
        return httpx.Response(status_code=answer.status, headers=answer.headers, stream=_Body(answer.stream),
                              extensions=answer.extensions)

    def close(self) -> None:
        self._pool.close()
