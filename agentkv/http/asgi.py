"""Small ASGI pieces the gateway and the embedded server share: one :class:`Reply` and its writer, one request-body
limit, one disconnect watcher.

- :class:`Reply`: an app's answer, its status, headers and body whole or as it comes; :func:`write` sends it.
- :func:`read_body`: a request's body read as it arrives, refused past a limit (:class:`BodyTooLarge`, a declared
  length over it before any byte is read); :class:`BodyLimit` is the same as a Starlette-style middleware
  (``__init__(app, ...)`` plus ``__call__(scope, receive, send)``) that answers the refusals itself and hands its app
  the body whole.
- :func:`serve_exchange`: an answer written unless the client disconnects first; a watcher cancels the task that
  serves the request when it does (the work in flight is then abandoned: an upstream request closed, a generation
  aborted).

    raw = await read_body(scope, receive, limit)                          # BodyTooLarge, ClientLeft
    reply = await serve_exchange(receive, send, answer(raw))              # written; None: the client left
    app = BodyLimit(endpoint, limit, refuse, timeout_s=30.0)              # endpoint: (await receive())["body"]

Plain ASGI on purpose: the gateway's routed POSTs are its hot path, and skipping Starlette's ``Request`` and
``Response`` objects saves about 0.1 ms a request on a 2-core machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JSON", "BodyLimit", "BodyTooLarge", "ClientLeft", "Receive", "Reply", "Send", "header", "read_body",
           "serve_exchange", "write"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # as ASGI servers (and starlette.types) type them
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
JSON = "application/json"


class BodyTooLarge(Exception):
    """The request's body is (or says it is) over the limit."""


class ClientLeft(Exception):
    """The client disconnected before its request's body was complete."""


@dataclass(slots=True)
class Reply:
    """An answer: its status, its headers, and its body whole (``body``) or as it comes (``chunks``, an async
    generator). ``finish`` is called once the reply is done with, however it ended: written, cut short by the
    client's leaving, or never begun (a generator never started runs none of its own cleanup)."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = JSON
    chunks: AsyncIterator[bytes] | None = None
    finish: Callable[[], None] | None = None


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The request header ``name`` (lower-case bytes) as text, or None; the first one when it repeats."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def read_body(scope: Mapping[str, Any], receive: Receive, limit: int) -> bytes:
    """The request's body, read as it arrives; :class:`BodyTooLarge` past ``limit`` bytes (or a declared length
    over it, before any byte is read), :class:`ClientLeft` when the client disconnects first."""
    declared = header(scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # "http.disconnect"
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def write(send: Send, reply: Reply) -> None:
    """Send ``reply``: its head, then its body whole or piece by piece; then close its generator and call its
    ``finish``, also when the client's leaving cancels this at any point."""
    try:
        headers = [(b"content-type", reply.content_type.encode("latin-1"))]
        headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers.items()]
        if reply.chunks is None:
            headers.append((b"content-length", b"%d" % len(reply.body)))
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": reply.body})
            return
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        async for chunk in reply.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        try:
            if reply.chunks is not None:
                await reply.chunks.aclose()  # type: ignore[attr-defined]  # an async generator's
        finally:
            if reply.finish is not None:
                reply.finish()


class BodyLimit:
    """ASGI middleware: an HTTP request's body read within ``limit`` bytes (and ``timeout_s`` seconds, when given)
    before ``app`` runs; ``app`` then receives it whole, in one ``http.request`` message, and after it what the
    client says next (its disconnect). A body over the limit is answered ``refuse(scope, 413)``, one that is not in
    within ``timeout_s`` ``refuse(scope, 408)``, and ``app`` is not called; nor when the client leaves first."""

    def __init__(self, app: App, limit: int, refuse: Callable[[Scope, int], Reply], *,
                 timeout_s: float | None = None) -> None:
        self.app, self.limit, self.refuse, self.timeout_s = app, limit, refuse, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(read_body(scope, receive, self.limit), self.timeout_s)
        except BodyTooLarge:
            await write(send, self.refuse(scope, 413))
            return
        except asyncio.TimeoutError:
            await write(send, self.refuse(scope, 408))
            return
        except ClientLeft:
            return
        await self.app(scope, _Replayed(body, receive), send)


class _Replayed:
    """A ``receive`` that gives the body read already, whole, then the client's own messages."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body: bytes | None = body
        self.receive = receive

    async def __call__(self) -> MutableMapping[str, Any]:
        if self.body is None:
            return await self.receive()
        body, self.body = self.body, None
        return {"type": "http.request", "body": body, "more_body": False}


async def serve_exchange(receive: Receive, send: Send, work: Awaitable[Reply]) -> Reply | None:
    """Answer with ``work``'s reply, written to the client; None (nothing written, ``work`` cancelled) when the
    client disconnects first. A watcher task waits on ``receive`` (the request's body already read) for the
    disconnect and cancels this task; it is started on the loop's next turn, which comes once this task first waits
    (so a request written upstream at once is written before it), and a disconnect that came earlier is what it
    receives first."""
    task = asyncio.current_task()
    assert task is not None
    watch = _Watch(task, receive)
    asyncio.get_running_loop().call_soon(watch.start)
    try:
        reply = await work
        await write(send, reply)
        return reply
    except asyncio.CancelledError:
        if not watch.left:
            raise
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+: this task goes on, no longer being cancelled
        if uncancel is not None:
            uncancel()
        return None
    finally:
        watch.stop()


class _Watch:
    """Cancels the exchange's task when its client disconnects (unless the exchange is over by then)."""

    def __init__(self, task: asyncio.Task[Any], receive: Receive) -> None:
        self.task, self.receive = task, receive
        self.left = self.done = False
        self.watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self.done:
            self.watcher = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        self.done = True
        if self.watcher is not None:
            self.watcher.cancel()

    async def run(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.left = True
            self.task.cancel()
