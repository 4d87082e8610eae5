"""The ASGI app, on plain ASGI: every request is handed to :func:`routes.handle` and its answer written.

The body is read within bounds by :class:`agentkv.http.asgi.BodyLimit` (the gateway's own limit): a
``Content-Length`` over the limit is answered 413 before anything is read, a streamed body as soon as it passes the
limit, and a body not complete within the client timeout 408. Parsing and planning run in the server's parse pool,
generation in its generation pool; the answer is an :class:`agentkv.http.asgi.Reply`, served by
:func:`agentkv.http.asgi.serve_exchange`, whose watcher cancels the request's task when its client disconnects: the
request is then aborted (the engine stops it at its next step and frees its KV). Every answer carries
``X-Request-Id`` (echoed, or generated).

Usage::

    uvicorn.Config(app(server), ...)          # server: a LocalServer (anything with pools, options and the engine)
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any, Protocol

from agentkv.events import emit
from agentkv.embedded.engine.limits import error_body
from agentkv.embedded.server import protocol, routes
from agentkv.embedded.server.bounds import http_error
from agentkv.embedded.server.served import Served
from agentkv.backends import redact_secrets
from agentkv.http.asgi import BodyLimit, Receive, Reply, Send, header, serve_exchange

__all__ = ["Hosting", "app"]


class Hosting(Served, Protocol):
    """A server the app runs requests for: what routes need, plus its two thread pools."""

    @property
    def pool(self) -> Executor:
        """Generation: each in-flight request holds a thread while it waits for or takes its turns."""

    @property
    def parse_pool(self) -> Executor:
        """Validation and planning, apart so that a full generation pool never delays a 400."""

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def client_timeout_s(self) -> float: ...


def app(served: Hosting) -> Any:
    """The ASGI app: each request's body within bounds, its answer from :func:`routes.handle`, plus X-Request-Id."""

    def refuse(scope: Any, status: int) -> Reply:
        """An HTTP-level error (413, 408); the connection is closed (its unread body cannot be skipped)."""
        emit("local.request.refused", level="warning", path=scope["path"], status=status)
        message = (f"The request body is larger than the server's limit of {served.max_body_bytes} bytes."
                   if status == 413 else
                   f"The request body was not received within {served.client_timeout_s:g} s.")
        return Reply(status, json.dumps(http_error(status, message)).encode(), {"connection": "close"})

    async def endpoint(scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the server runs without lifespan events, and serves no websocket
            return
        raw = (await receive())["body"]  # whole: BodyLimit has read it
        if await serve_exchange(receive, send, _answer(served, scope, raw)) is None:
            emit("local.request.disconnected", path=scope["path"])

    return BodyLimit(endpoint, served.max_body_bytes, refuse, timeout_s=served.client_timeout_s)


async def _answer(served: Hosting, scope: Any, raw: bytes) -> Reply:
    """The route's answer as a :class:`Reply`: whole (a deferred one generated in the pool first) or streamed."""
    loop = asyncio.get_running_loop()
    method, path = scope["method"], scope["path"]
    content_type = (header(scope, b"content-type") or "") if raw or method == "POST" else None
    logged = redact_secrets(_headers(scope)) if served.logs_requests else None  # never a credential
    answer = await loop.run_in_executor(served.parse_pool, routes.handle, served, method, path, raw, content_type,
                                        logged)
    headers = {"x-request-id": header(scope, b"x-request-id") or uuid.uuid4().hex}
    if answer.events is not None:
        return Reply(answer.status, headers={**headers, "cache-control": "no-cache"},
                     content_type=_media(answer.content_type), chunks=_relay(served, answer),
                     finish=answer.abort.set)  # a no-op once the stream has ended; stops it when the client left
    if answer.work is not None:
        await _finished(served, answer)
    return Reply(answer.status, answer.payload(), headers, _media(answer.content_type))


def _headers(scope: Any) -> dict[str, str]:
    """The request's headers as text (the first one when a name repeats)."""
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        headers.setdefault(bytes(name).decode("latin-1"), bytes(value).decode("latin-1"))
    return headers


def _media(content_type: str) -> str:
    """The content type as Starlette (and so vLLM's FastAPI) writes it: a ``text/*`` type names its charset."""
    return f"{content_type}; charset=utf-8" if content_type.startswith("text/") and "charset=" not in content_type \
        else content_type


async def _finished(served: Hosting, answer: routes.RouteAnswer) -> None:
    """Run the answer's deferred work in a worker thread; if the client disconnects meanwhile (this task cancelled),
    abort it."""
    try:
        await asyncio.get_running_loop().run_in_executor(served.pool, answer.finish)
    except asyncio.CancelledError:  # the client left, or the server is stopping: stop the generation too
        answer.abort.set()
        raise


async def _relay(served: Hosting, answer: routes.RouteAnswer) -> AsyncIterator[bytes]:
    """Iterate the answer's SSE events in a worker thread and pass them on; on disconnect, abort the request.

    The worker keeps draining after an abort, so the engine ends the request (and frees its KV) at its next
    step even though nobody reads the rest.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()
    assert answer.events is not None
    events = answer.events

    def pump() -> None:
        try:
            for event in events:
                loop.call_soon_threadsafe(queue.put_nowait, event)
        except Exception as exc:  # headers are sent: an error event then [DONE], as vLLM's stream generators do
            emit("local.stream.failed", level="exception", error=type(exc).__name__)
            error = error_body(str(exc), type="InternalServerError", code=500)
            for event in (protocol.sse(error), protocol.sse("[DONE]")):
                loop.call_soon_threadsafe(queue.put_nowait, event)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
            loop.call_soon_threadsafe(queue.put_nowait, done)

    served.pool.submit(pump)
    try:
        while True:
            item = await queue.get()
            if item is done:
                return
            yield item
    finally:
        answer.abort.set()  # a no-op once the stream has ended; stops the request when the client left early
