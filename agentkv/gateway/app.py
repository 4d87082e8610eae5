"""The gateway's ASGI app (Starlette): a list of routes, each a small async function; the lifespan owns the
shared :class:`~agentkv.gateway.context.GatewayContext` (the upstream client, the Sessions, the metrics).

    app = create_app(GatewayConfig(fast_url=..., fast_model=..., slow_url=..., slow_model=...))
    uvicorn.run(app)                                      # or: agentkv gateway --fast ... --workers 4

Routes: ``GET /health`` and ``GET /metrics`` (no key needed), ``GET /v1/models``, ``POST /v1/chat/completions``
and ``POST /v1/completions``; any other ``/v1/*`` path is a 404 in OpenAI's error shape. Every ``/v1/*`` request
with a keys file needs ``Authorization: Bearer <key>`` (401 otherwise). Bodies over the limit are a 413, bodies
that are not a JSON object (or whose ``messages`` is not an array of objects) a 400; these answers reach no
backend. A client that disconnects before its answer is complete aborts the upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv.events import defer_events, digest, emit
from agentkv.gateway.config import GatewayConfig
from agentkv.gateway.context import GatewayContext
from agentkv.gateway.identity import conversation_id
from agentkv.gateway.metrics import CONTENT_TYPE_LATEST
from agentkv.gateway.relay import own_error, relay

__all__ = ["MODEL_ID", "app_from_env", "create_app", "request_problem"]

MODEL_ID = "agentkv"
"""The one model ``GET /v1/models`` lists: the gateway picks the backend, whatever ``model`` a request names."""
SESSION_HEADER = "x-session-id"

_Handler = Callable[[Request, GatewayContext], Awaitable[Response]]


class _TooLarge(Exception):
    pass


def request_problem(body: Any, *, chat: bool) -> str | None:
    """Why a parsed body cannot be routed (a 400's message), or None when it can."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return "'messages' must be an array of message objects"
        if not all(isinstance(m, dict) for m in messages):
            return "every entry of 'messages' must be an object"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        return None
    return "'prompt' must be a string or an array of strings"


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read as it arrives; :class:`_TooLarge` past ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _guarded(handler: _Handler) -> Callable[[Request], Awaitable[Response]]:
    """A ``/v1/*`` endpoint: the tenant's key checked first (401 in OpenAI's shape, nothing sent upstream)."""

    async def endpoint(request: Request) -> Response:
        defer_events()  # this request's events are logged while it waits for its backend, not before
        ctx: GatewayContext = request.app.state.ctx
        tenant = ctx.tenant(request.headers.get("authorization"))
        if tenant is None:
            ctx.metrics.rejections.labels("401").inc()
            emit("gateway.unauthorized", path=request.url.path)
            return own_error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'")
        request.state.tenant = tenant
        return await handler(request, ctx)

    return endpoint


async def _routed(request: Request, ctx: GatewayContext, *, chat: bool) -> Response:
    started = time.perf_counter()
    try:
        raw = await read_body(request, ctx.config.max_body_bytes)
    except _TooLarge:
        ctx.metrics.rejections.labels("413").inc()
        return own_error(413, f"the request body is larger than {ctx.config.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    problem = request_problem(body, chat=chat) if body is not None else "the request body is not valid JSON"
    if problem is not None:
        ctx.metrics.rejections.labels("400").inc()
        return own_error(400, problem)
    conversation = conversation_id(request.headers.get(SESSION_HEADER), body)
    session = ctx.session(request.state.tenant, conversation)
    response = await _unless_disconnected(request, relay(ctx, session, body))
    asyncio.get_running_loop().call_soon(  # logged once the answer is on its way
        _log_request, request.state.tenant, conversation, len(raw), response, bool(body.get("stream")),
        (time.perf_counter() - started) * 1000)
    return response


def _log_request(tenant: str, conversation: str, size: int, response: Response, stream: bool, ms: float) -> None:
    emit("gateway.request", tenant=tenant, conversation=digest(conversation), bytes=size, status=response.status_code,
         backend=response.headers.get("x-agentkv-backend"), route=response.headers.get("x-agentkv-route"),
         stream=stream, ms=round(ms, 2))


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s answer, or, when the client disconnects first, a 499 with ``work`` cancelled (its upstream
    request closed): a watcher task cancels this one at the client's disconnect."""
    task = asyncio.current_task()
    assert task is not None
    left = asyncio.Event()
    watcher = asyncio.get_running_loop().create_task(_cancel_at_disconnect(request, task, left))
    try:
        return await work
    except asyncio.CancelledError:
        if not left.is_set():
            raise
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+: this task goes on, no longer being cancelled
        if uncancel is not None:
            uncancel()
        emit("gateway.client_disconnected", path=request.url.path)
        return Response(status_code=499)
    finally:
        watcher.cancel()


async def _cancel_at_disconnect(request: Request, task: asyncio.Task[Any], left: asyncio.Event) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    left.set()
    task.cancel()


async def chat_completions(request: Request, ctx: GatewayContext) -> Response:
    """``POST /v1/chat/completions``: routed fast or slow, JSON or SSE."""
    return await _routed(request, ctx, chat=True)


async def completions(request: Request, ctx: GatewayContext) -> Response:
    """``POST /v1/completions``: a text completion, routed by the same rules."""
    return await _routed(request, ctx, chat=False)


async def models(request: Request, ctx: GatewayContext) -> Response:
    """``GET /v1/models``: one model, ``agentkv``, as long as the slow backend's window."""
    window = (await ctx.discovery.awindow(ctx.slow)).window
    entry = {"id": MODEL_ID, "object": "model", "created": ctx.created, "owned_by": "agentkv", "root": MODEL_ID,
             "parent": None, "max_model_len": window}
    return JSONResponse({"object": "list", "data": [entry]})


async def not_found(request: Request, ctx: GatewayContext) -> Response:
    """Any other ``/v1/*`` path."""
    return own_error(404, f"no route {request.method} {request.url.path} on the agentkv gateway")


async def health(request: Request) -> Response:
    """``GET /health``: 200 once the app has started."""
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text."""
    ctx: GatewayContext = request.app.state.ctx
    ctx.metrics.sessions.set(len(ctx.sessions))
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(config: GatewayConfig, *, context: Callable[[], GatewayContext] | None = None) -> Starlette:
    """The gateway for ``config``; ``context`` builds the shared state instead (tests hand in their own)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx = context() if context is not None else GatewayContext(config)
        app.state.ctx = ctx
        try:
            yield
        finally:
            await ctx.aclose()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/v1/chat/completions", _guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", _guarded(completions), methods=["POST"]),
        Route("/v1/{path:path}", _guarded(not_found), methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def app_from_env() -> Starlette:
    """The app for the configuration in ``AGENTKV_GATEWAY_CONFIG``: the factory uvicorn's workers import."""
    return create_app(GatewayConfig.from_env())
