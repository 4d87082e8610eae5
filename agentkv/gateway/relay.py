"""One routed request, from the client's body to a backend's answer, through the Session's public core.

This is the httpx transport's loop (:mod:`agentkv.integrations.openai`) over a gateway's upstream client, and it
decides nothing itself: :meth:`Session.aprepare` counts, routes, clamps and warms; each try's body is the
transport's :func:`~agentkv.integrations.openai.outgoing_body` (the backend's model id, the budget, the tenant's
salt); a rejection (400, 413) or an outage (502, 503, 504, an unreachable backend) goes to
:meth:`Session.arecover`, which clamps, escalates or fails over, or gives the error back to pass on; the answer
goes to :meth:`Session.answered`, a stream's once it has ended. A stream's bytes pass through as they come.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Mapping

import httpx

from agentkv._session.attempts import Attempt
from agentkv._session.driver import Session
from agentkv.errors import ContextOverflowError
from agentkv.events import emit
from agentkv.gateway.context import GatewayContext
from agentkv.gateway.exchange import JSON, Reply
from agentkv.gateway.upstream import Started, UpstreamResponse
from agentkv.gateway.replies import error_body, route_headers, upstream_error_body
from agentkv.integrations.openai import Rejected, UsageWatch, counted_view, outgoing_body

__all__ = ["RECOVERABLE", "own_error", "relay", "try_body", "upstream_url"]

RECOVERABLE = (400, 413, 502, 503, 504)
"""Statuses handed to :meth:`Session.arecover`: a possible context overflow, or an outage."""


def upstream_url(attempt: Attempt) -> str:
    """The endpoint of this try: the backend's ``/chat/completions``, or ``/completions`` for a text completion."""
    base = (attempt.backend.api_base or "").rstrip("/")
    return f"{base}/completions" if attempt.text else f"{base}/chat/completions"


def try_body(body: Mapping[str, Any], attempt: Attempt, salt: str | None) -> bytes:
    """This try's JSON: the client's body addressed to the attempt's backend (whatever ``model`` it named)."""
    return json.dumps(outgoing_body({**body, "model": attempt.backend.served_model}, attempt, salt)).encode()


def own_error(status: int, message: str) -> Reply:
    """An answer the gateway makes itself (no route headers)."""
    return Reply(status, error_body(status, message))


async def relay(ctx: GatewayContext, session: Session, body: dict[str, Any]) -> Reply:
    """Route ``body`` through ``session`` and answer with what the final backend said.

    A request the Session can vouch for before counting it (:meth:`Session.presend`: fast, as it is, far from
    every boundary) is written to fast at once, on a kept connection, and the Session prepares it while fast
    works; when the prepared try's URL and bytes are not exactly what went out, that request is abandoned (its
    connection closed) and the prepared one sent instead."""
    started = time.perf_counter()
    counted = counted_view(body)
    early = _presend(ctx, session, body, counted)
    try:
        attempt = await session.aprepare(counted)
    except (ContextOverflowError, ValueError) as refusal:  # InvalidRequestError included
        if early is not None:
            early.cancel()
        ctx.metrics.rejections.labels("400").inc()
        return own_error(400, str(refusal))
    except BaseException:  # the client left (cancelled) or the Session failed: the early request is abandoned
        if early is not None:
            early.cancel()
        raise
    ctx.metrics.warm(attempt.warm)
    stream = bool(body.get("stream"))
    while True:
        url, content = upstream_url(attempt), try_body(body, attempt, session.cache_salt)
        try:
            if early is not None and early.url == url and early.content == content:
                response = await early.response()
            else:
                if early is not None:
                    early.cancel()
                    ctx.metrics.presend_discarded.inc()
                response = await ctx.send(url, content)
        except httpx.HTTPError as error:
            early = None
            retry = await _next_try(ctx, session, attempt, error)
            if retry is None:
                return _unreachable(ctx, attempt, error)
            attempt = retry
            continue
        early = None
        if response.status_code in RECOVERABLE:
            raw = await _read_closed(response)
            retry = await _next_try(ctx, session, attempt, Rejected(response.status_code, raw.decode("utf-8", "replace")))
            if retry is None:
                return _upstream_error(ctx, attempt, response.status_code, raw)
            attempt = retry
            continue
        ctx.metrics.observe(attempt.decision.role, time.perf_counter() - started)
        if response.status_code >= 400:
            return _upstream_error(ctx, attempt, response.status_code, await _read_closed(response))
        ctx.metrics.answered(attempt.decision.role, attempt.decision.reason)
        if stream:
            return _streamed(session, attempt, response)
        raw = await _read_closed(response)
        _record_later(session, attempt, raw)
        return Reply(response.status_code, raw, route_headers(attempt.decision),
                     response.headers.get("content-type", JSON))


def _record_later(session: Session, attempt: Attempt, answer: bytes | UsageWatch) -> None:
    """Have the Session record ``answer`` (a JSON answer's bytes, or a stream's usage watch) once it is on its way:
    by the event loop's next turn, which comes after the request's task has written its response (nothing on the
    request path waits for the Session's bookkeeping)."""
    asyncio.get_running_loop().call_soon(_record, session, attempt, answer)


def _record(session: Session, attempt: Attempt, answer: bytes | UsageWatch) -> None:
    """What the Session records of an answer (its usage); a failure is logged, never raised to the loop."""
    try:
        usage = answer.usage_chunk if isinstance(answer, UsageWatch) else _parsed(answer)
        session.answered(attempt, usage, asynchronous=True)
    except Exception as error:  # pragma: no cover - recording must never take a request down
        emit("gateway.record_failed", level="warning", error=type(error).__name__)


def _presend(ctx: GatewayContext, session: Session, body: dict[str, Any], counted: dict[str, Any]) -> Started | None:
    """The request written to fast before it is counted, when the Session vouches for it and a kept connection is
    idle (see :func:`relay`); else None."""
    attempt = session.presend(counted)
    if attempt is None:
        return None
    started = ctx.upstream.start(upstream_url(attempt), try_body(body, attempt, session.cache_salt))
    if started is not None:
        ctx.metrics.presends.inc()
    return started


async def _next_try(ctx: GatewayContext, session: Session, attempt: Attempt, error: Exception) -> Attempt | None:
    """The Session's next try after ``error`` (counted by kind), or None when the error is the answer."""
    try:
        retry = await session.arecover(attempt, error)
    except (Rejected, ContextOverflowError, httpx.HTTPError):
        return None
    if retry.decision.reason == "failover":
        ctx.metrics.failovers.inc()
    else:
        ctx.metrics.overflows_recovered.inc()
    return retry


def _parsed(raw: bytes) -> Any:
    """A JSON answer parsed for :meth:`Session.answered` (its ``usage``); ``{}`` when it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        return {}


async def _read_closed(response: UpstreamResponse) -> bytes:
    try:
        return await response.aread()
    finally:
        await response.aclose()


def _upstream_error(ctx: GatewayContext, attempt: Attempt, status: int, raw: bytes) -> Reply:
    """A backend's error answer, in OpenAI's shape with its status, from the backend that produced it."""
    ctx.metrics.upstream_errors.labels(attempt.decision.role, str(status)).inc()
    emit("gateway.upstream_error", backend=attempt.decision.role, status=status, bytes=len(raw))
    return Reply(status, upstream_error_body(status, raw), route_headers(attempt.decision))


def _unreachable(ctx: GatewayContext, attempt: Attempt, error: httpx.HTTPError) -> Reply:
    """No backend could be reached (or the last one timed out): 504 for a timeout, else 502."""
    status = 504 if isinstance(error, httpx.TimeoutException) else 502
    ctx.metrics.upstream_errors.labels(attempt.decision.role, str(status)).inc()
    emit("gateway.unreachable", level="warning", backend=attempt.decision.role, error=type(error).__name__)
    return own_error(status, f"the {attempt.decision.role} backend could not be reached ({type(error).__name__})")


def _streamed(session: Session, attempt: Attempt, response: UpstreamResponse) -> Reply:
    headers = {**route_headers(attempt.decision), "cache-control": "no-cache"}
    watch = UsageWatch()

    def finish() -> None:  # the stream is over (ended, cut, or never begun): close upstream, record the usage seen
        response.close()
        _record_later(session, attempt, watch)

    return Reply(response.status_code, headers=headers, content_type=response.headers.get(
        "content-type", "text/event-stream"), chunks=_passed_through(attempt, response, watch), finish=finish)


async def _passed_through(attempt: Attempt, response: UpstreamResponse, watch: UsageWatch) -> AsyncIterator[bytes]:
    """The backend's SSE bytes as they arrive, each read by ``watch`` for the usage first. A client that leaves
    cancels the writer, which closes this generator and the upstream response (the backend then aborts)."""
    try:
        async for data in response.aiter_raw():
            watch.feed(data)
            yield data
    except httpx.HTTPError as error:  # headers are sent: end with an error event, as vLLM's stream generators do
        emit("gateway.stream_broken", level="warning", backend=attempt.decision.role, error=type(error).__name__)
        yield b"data: " + error_body(502, f"the backend's stream broke ({type(error).__name__})") + b"\n\n"
