"""The gateway's ASGI app: the two routed POSTs on plain ASGI (:mod:`agentkv.http.asgi`'s pieces: they are the hot
path), and a Starlette app for the rest, a list of routes, each a small async function, whose lifespan owns the
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv._session import Session
from agentkv.conversations import conversation_id
from agentkv.events import defer_events, digest, emit
from agentkv.gateway.config import GatewayConfig
from agentkv.gateway.context import GatewayContext
from agentkv.gateway.metrics import CONTENT_TYPE_LATEST
from agentkv.gateway.relay import own_error, relay
from agentkv.http.asgi import BodyTooLarge, ClientLeft, Receive, Reply, Send, header, read_body, serve_exchange, write

__all__ = ["MODEL_ID", "GatewayApp", "app_from_env", "create_app", "request_problem"]

MODEL_ID = "agentkv"
"""The one model ``GET /v1/models`` lists: the gateway picks the backend, whatever ``model`` a request names."""
SESSION_HEADER = b"x-session-id"
ROUTED = {"/v1/chat/completions": True, "/v1/completions": False}
"""The routed POST endpoints (served on plain ASGI), each with whether it is the chat one."""

_Handler = Callable[[Request, GatewayContext], Awaitable[Response]]


class GatewayApp:
    """The gateway's ASGI app. The routed POSTs are its hot path and are served here on plain ASGI
    (:mod:`agentkv.http.asgi`); every other request, and the lifespan, go to the Starlette app of the
    other routes (``routes``), whose ``state`` holds the process's :class:`GatewayContext`."""

    def __init__(self, routes: Starlette) -> None:
        self.routes = routes

    @property
    def state(self) -> State:
        return self.routes.state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = ROUTED.get(_route_path(scope))
            if chat is not None:
                await _routed(scope, receive, send, self.routes.state.ctx, chat=chat)
                return
        await self.routes(scope, receive, send)


def _route_path(scope: MutableMapping[str, Any]) -> str:
    """The path a route matches: the request's, less the ``root_path`` it is mounted under (ASGI servers put
    the root path in ``path`` too, as Starlette's router expects)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


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


def _tenant(ctx: GatewayContext, authorization: str | None, path: str) -> str | Reply:
    """The tenant a request's key names, or the 401 (OpenAI's shape, nothing sent upstream) when it names none."""
    tenant = ctx.tenant(authorization)
    if tenant is not None:
        return tenant
    ctx.metrics.rejections.labels("401").inc()
    emit("gateway.unauthorized", path=path)
    return own_error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'")


def _guarded(handler: _Handler) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette ``/v1/*`` endpoint: the tenant's key checked first."""

    async def endpoint(request: Request) -> Response:
        ctx: GatewayContext = request.app.state.ctx
        tenant = _tenant(ctx, request.headers.get("authorization"), request.url.path)
        if isinstance(tenant, Reply):
            return _response(tenant)
        request.state.tenant = tenant
        return await handler(request, ctx)

    return endpoint


async def _routed(scope: Mapping[str, Any], receive: Receive, send: Send, ctx: GatewayContext, *, chat: bool) -> None:
    """A routed POST: the key, the body (413 past the limit, 400 when it cannot be routed), the conversation's
    Session, and the relay's answer, written unless the client leaves first."""
    defer_events()  # this request's events are logged while it waits for its backend, not before
    started = time.perf_counter()
    tenant = _tenant(ctx, header(scope, b"authorization"), scope["path"])
    if isinstance(tenant, Reply):
        await write(send, tenant)
        return
    try:
        raw = await read_body(scope, receive, ctx.config.max_body_bytes)
    except BodyTooLarge:
        ctx.metrics.rejections.labels("413").inc()
        await write(send, own_error(413, f"the request body is larger than {ctx.config.max_body_bytes} bytes"))
        return
    except ClientLeft:
        emit("gateway.client_disconnected", path=scope["path"])
        return
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    problem = request_problem(body, chat=chat) if body is not None else "the request body is not valid JSON"
    if problem is not None:
        ctx.metrics.rejections.labels("400").inc()
        await write(send, own_error(400, problem))
        return
    conversation = conversation_id(header(scope, SESSION_HEADER), body)
    reply = await serve_exchange(receive, send, _answer(ctx, ctx.session(tenant, conversation), body))
    if reply is None:
        emit("gateway.client_disconnected", path=scope["path"])
    asyncio.get_running_loop().call_soon(  # logged once the answer is written (a stream's to its end)
        _log_request, tenant, conversation, len(raw), reply, bool(body.get("stream")),
        (time.perf_counter() - started) * 1000)


async def _answer(ctx: GatewayContext, session: Session, body: dict[str, Any]) -> Reply:
    """The relay's reply; a 500 in OpenAI's shape (its error's type logged) when the gateway itself fails."""
    try:
        return await relay(ctx, session, body)
    except Exception as error:
        emit("gateway.failed", level="error", error=type(error).__name__)
        return own_error(500, f"the gateway failed on this request ({type(error).__name__})")


def _log_request(tenant: str, conversation: str, size: int, reply: Reply | None, stream: bool, ms: float) -> None:
    headers = reply.headers if reply is not None else {}
    emit("gateway.request", tenant=tenant, conversation=digest(conversation), bytes=size,
         status=reply.status if reply is not None else 499, backend=headers.get("x-agentkv-backend"),
         route=headers.get("x-agentkv-route"), stream=stream, ms=round(ms, 2))


async def models(request: Request, ctx: GatewayContext) -> Response:
    """``GET /v1/models``: one model, ``agentkv``, as long as the slow backend's window."""
    window = (await ctx.discovery.awindow(ctx.slow)).window
    entry = {"id": MODEL_ID, "object": "model", "created": ctx.created, "owned_by": "agentkv", "root": MODEL_ID,
             "parent": None, "max_model_len": window}
    return JSONResponse({"object": "list", "data": [entry]})


async def not_found(request: Request, ctx: GatewayContext) -> Response:
    """Any other ``/v1/*`` path."""
    return _response(own_error(404, f"no route {request.method} {request.url.path} on the agentkv gateway"))


def _response(reply: Reply) -> Response:
    """A whole :class:`Reply` as a Starlette answer."""
    return Response(reply.body, status_code=reply.status, media_type=reply.content_type, headers=dict(reply.headers))


async def health(request: Request) -> Response:
    """``GET /health``: 200 once the app has started."""
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text."""
    ctx: GatewayContext = request.app.state.ctx
    ctx.metrics.sessions.set(len(ctx.sessions))
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(config: GatewayConfig, *, context: Callable[[], GatewayContext] | None = None) -> GatewayApp:
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
        Route("/v1/{path:path}", _guarded(not_found), methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
    return GatewayApp(Starlette(routes=routes, lifespan=lifespan))


def app_from_env() -> GatewayApp:
    """The app for the configuration in ``AGENTKV_GATEWAY_CONFIG``: the factory uvicorn's workers import."""
    return create_app(GatewayConfig.from_env())
