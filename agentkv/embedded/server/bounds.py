"""What a client may make the server hold: request bodies in a log, body size, and time to send a request.

- **The request log** is off by default: a server keeps no request bodies (every tenant's prompts would stay in
  memory, and 20 requests of 5 MB grew ``agentkv serve`` by 120 MB). Tests opt in with ``request_log=N`` and
  see the last ``N`` requests in :attr:`LocalServer.requests`.
- **Body size**: beyond ``max_body_bytes`` (:data:`DEFAULT_MAX_BODY_BYTES`, 32 MiB) a request is answered 413,
  from its ``Content-Length`` before anything is read, or as soon as a streamed body passes the limit.
- **Slow clients**: a connection has ``client_timeout_s`` (:data:`DEFAULT_CLIENT_TIMEOUT_S`) to send a request's
  headers, counted from when it opened or its previous answer ended, and as long again for the body; then the
  connection is closed (headers) or answered 408 (body).

The errors are vLLM's JSON for an HTTP error, ``{"error": {"message", "type": <HTTP phrase>, "param", "code"}}``.

Usage::

    log = RequestLog(100)                  # RequestLog(0) keeps nothing
    log.record("POST", "/v1/chat/completions", body)
    declared_too_large("1000000000", DEFAULT_MAX_BODY_BYTES)   # True: answer 413 before reading
"""

from __future__ import annotations

import threading
from collections import deque
from http import HTTPStatus
from typing import Any, Mapping, NamedTuple

from agentkv.embedded.engine.limits import error_body

__all__ = ["DEFAULT_CLIENT_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "LoggedRequest", "RequestLog",
           "RequestLogDisabled", "declared_too_large", "http_error"]

DEFAULT_MAX_BODY_BYTES = 32 << 20
"""32 MiB: above any prompt the embedded windows can hold, even JSON-escaped, far below what fills memory."""
DEFAULT_CLIENT_TIMEOUT_S = 30.0
"""A client's time to send a request's headers, and again its body."""


class LoggedRequest(NamedTuple):
    """One request as the server received it; ``body`` is the parsed JSON (None when absent or malformed)."""

    method: str
    path: str
    body: Any
    headers: Mapping[str, str] = {}  # noqa: RUF012 - a NamedTuple default, never mutated: names lower-cased


class RequestLogDisabled(RuntimeError):
    """Reading the log of a server that keeps none (``request_log=0``, the default)."""


class RequestLog:
    """The last ``capacity`` requests, thread-safe; ``capacity`` 0 records nothing."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError("request_log must be 0 (off) or a positive number of requests")
        self.capacity = capacity
        self._entries: deque[LoggedRequest] = deque(maxlen=capacity or 1)
        self._lock = threading.Lock()

    def record(self, method: str, path: str, body: Any, headers: Mapping[str, str] | None = None) -> None:
        """Keep this request (dropping the oldest past ``capacity``); a no-op when the log is off."""
        if self.capacity:
            with self._lock:
                self._entries.append(LoggedRequest(method, path, body, dict(headers or {})))

    def entries(self) -> list[LoggedRequest]:
        """A copy of the kept requests, oldest first; raises :class:`RequestLogDisabled` when the log is off."""
        if not self.capacity:
            raise RequestLogDisabled("this server keeps no request log: start it with request_log=N "
                                     "(LocalServer(..., request_log=100)) to read its requests")
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def declared_too_large(content_length: str | None, limit: int) -> bool:
    """Whether a ``Content-Length`` header already says the body is over ``limit`` bytes."""
    return content_length is not None and content_length.strip().isdigit() and int(content_length) > limit


def http_error(status: int, message: str) -> dict[str, Any]:
    """vLLM's JSON for an HTTP-level error: the type is the status's phrase (``"Request Entity Too Large"``)."""
    return error_body(message, type=HTTPStatus(status).phrase, code=status)
