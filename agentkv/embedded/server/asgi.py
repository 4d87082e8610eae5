"""The ASGI app: Starlette, as vLLM serves, with one catch-all route handing every request to :func:`routes.handle`.

The body is read within bounds (:mod:`agentkv.embedded.server.bounds`): a ``Content-Length`` over the limit is
answered 413 before anything is read, a streamed body as soon as it passes the limit, and a body not complete
within the client timeout 408. Parsing and planning run in the server's parse pool, generation in its generation
pool; a client that disconnects has its request aborted (the engine stops it at its next step and frees its KV).
Every answer carries ``X-Request-Id`` (echoed, or generated).

Usage::

    uvicorn.Config(app(server), ...)          # server: a LocalServer (anything with pools, options and the engine)
"""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import Executor
from typing import Any, Protocol

from agentkv.events import emit
from agentkv.embedded.engine.limits import error_body
from agentkv.embedded.server import protocol, routes
from agentkv.embedded.server.bounds import declared_too_large, http_error
from agentkv.embedded.server.served import Served
from agentkv.backends import redact_secrets

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


class _TooLarge(Exception):
    """The body passed the limit while it was read."""


async def _read_body(request: Any, limit: int) -> bytes:
    """The whole body, refusing (``_TooLarge``) as soon as more than ``limit`` bytes have arrived."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def app(served: Hosting) -> Any:
    """The ASGI app: one catch-all route that hands the request to :func:`routes.handle`, plus X-Request-Id."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]

    def refuse(path: str, status: int, message: str) -> Response:
        """An HTTP-level error; the connection is closed (its unread body cannot be skipped)."""
        emit("local.request.refused", level="warning", path=path, status=status)
        body = json.dumps(http_error(status, message)).encode()
        return Response(body, status_code=status, media_type="application/json", headers={"connection": "close"})

    async def endpoint(request: Request) -> Response:
        path, limit = request.url.path, served.max_body_bytes
        too_large = f"The request body is larger than the server's limit of {limit} bytes."
        if declared_too_large(request.headers.get("content-length"), limit):
            return refuse(path, 413, too_large)
        try:
            raw = await asyncio.wait_for(_read_body(request, limit), served.client_timeout_s)
        except _TooLarge:
            return refuse(path, 413, too_large)
        except asyncio.TimeoutError:
            return refuse(path, 408, f"The request body was not received within {served.client_timeout_s:g} s.")
        loop = asyncio.get_running_loop()
        content_type = request.headers.get("content-type", "") if raw or request.method == "POST" else None
        logged = redact_secrets(dict(request.headers)) if served.logs_requests else None  # never a credential
        reply = await loop.run_in_executor(served.parse_pool, routes.handle, served, request.method,
                                           request.url.path, raw, content_type, logged)
        headers = {"x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex}
        if reply.events is not None:
            return StreamingResponse(_relay(served, reply, request), status_code=reply.status,
                                     media_type=reply.content_type, headers={**headers, "cache-control": "no-cache"})
        if reply.work is not None:
            await _finish_unless_gone(served, reply, request)
        return Response(reply.payload(), status_code=reply.status, media_type=reply.content_type, headers=headers)

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=methods)])


async def _finish_unless_gone(served: Hosting, reply: routes.Reply, request: Any) -> None:
    """Run the reply's deferred work in a worker thread; if the client disconnects meanwhile, abort it."""
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(served.pool, reply.finish)
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=0.05)
            if not work.done() and await request.is_disconnected():
                reply.abort.set()
                emit("local.request.disconnected", path=request.url.path)
        await work
    finally:
        if not work.done():  # cancelled (the server is stopping): stop the generation too
            reply.abort.set()


async def _relay(served: Hosting, reply: routes.Reply, request: Any) -> Any:
    """Iterate the reply's SSE events in a worker thread and pass them on; on disconnect, abort the request.

    The worker keeps draining after an abort, so the engine ends the request (and frees its KV) at its next
    step even though nobody reads the rest.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()
    assert reply.events is not None
    events = reply.events

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
        reply.abort.set()  # a no-op once the stream has ended; stops the request when the client left early
