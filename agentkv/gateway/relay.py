"""One routed request, from the client's body to a backend's answer, through the Session's loop.

It decides nothing itself: :meth:`Session.aprepare` counts, routes, clamps and warms; the turn then runs in the
Session's one loop (:meth:`Session.aturn`, the same as ``Session.acompletion``'s and the OpenAI
transport's) over the gateway's upstream client: each try's body is :attr:`Attempt.content <agentkv.Attempt.content>` (the
backend's model id, the budget, the tenant's salt), an error answer or an outage is retried, clamped, escalated or
failed over as the Session's decision says, and what ends the turn is answered in OpenAI's shape. The answer goes to
:meth:`Session.answered`, a stream's once it has ended. A stream's bytes pass through as they come.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from agentkv._session import Attempt, Session, TurnEnd
from agentkv.errors import AnswerTooLarge, ContextOverflowError, PoolExhaustedError
from agentkv.events import emit
from agentkv.gateway.context import GatewayContext
from agentkv.http.asgi import JSON, Reply
from agentkv.http.transport import HttpAnswer, HttpError, StartedPost
from agentkv.gateway.replies import error_body, route_headers, upstream_error_body
from agentkv.retry import outage_cause
from agentkv.wire.openai import Rejected, UsageWatch

__all__ = ["RECOVERABLE", "own_error", "relay"]

RECOVERABLE = (400, 413, 502, 503, 504)
"""Statuses that may be a context overflow or an outage: a try answered so is recovered or failed over, not
timed in the gateway's latency histogram."""


def own_error(status: int, message: str) -> Reply:
    """An answer the gateway makes itself (no route headers)."""
    return Reply(status, error_body(status, message))


async def relay(ctx: GatewayContext, session: Session, body: dict[str, Any]) -> Reply:
    """Route ``body`` through ``session`` and answer with what the final backend said.

    A request the Session can vouch for before counting it (:meth:`Session.presend`: fast, as it is, far from
    every boundary) is written to fast at once, on a kept connection, and the Session prepares it while fast
    works; when the prepared try's URL and bytes are not exactly what went out, that request is abandoned (its
    connection closed) and the prepared one sent instead. Every try after that is the Session's loop
    (:meth:`Session.aturn`): retried, recovered and failed over as ``Session.acompletion``'s."""
    started = time.perf_counter()
    body = {**body, "model": session.fast.served_model}  # a gateway's clients name any model: fast serves it
    early = _presend(ctx, session, body)
    try:
        attempt = await session.aprepare(body)
    except BaseException as failure:  # refused, the client left (cancelled), or the Session failed: early abandoned
        if early is not None:
            early.cancel()
        if not isinstance(failure, (ContextOverflowError, ValueError)):  # InvalidRequestError is a ValueError
            raise
        ctx.metrics.rejections.labels("400").inc()
        return own_error(400, str(failure))
    ctx.metrics.warm(attempt.warm)
    tries = _Tries(ctx, body, early, started)
    try:
        # each try sent once: a gateway's clients retry on their own (the OpenAI SDK twice by default), so an outage
        # fails over at once and a 429 or 5xx that is not an outage reaches the client
        ended = await session.aturn(attempt, tries.send, streamed=tries.stream, retries=False)
    finally:
        tries.abandon()  # the turn never sent its first try (a handoff failed, the client left)
    _count_moves(ctx, ended.attempt)
    return _answer(ctx, session, ended, tries.stream, tries.headed - started)


class _Tries:
    """The tries of one relayed request: the first takes the early request when it is exactly what the Session
    prepared; each answer's headers time the latency histogram (``headed``)."""

    def __init__(self, ctx: GatewayContext, body: dict[str, Any], early: StartedPost | None, started: float) -> None:
        self.ctx, self.body, self.early = ctx, body, early
        self.stream = bool(body.get("stream"))
        self.headed = started  # when the last try's answer headers came

    async def send(self, attempt: Attempt) -> tuple[HttpAnswer, bytes]:
        """One try: the backend's answer, its body read whole unless it streams (a cut answer is an outage)."""
        url, content = attempt.url, attempt.content
        taken, self.early = self.early, None  # the early request serves the first try only
        if taken is not None and taken.url == url and taken.content == content:
            response = await taken.response()
        else:
            if taken is not None:
                taken.cancel()
                self.ctx.metrics.presend_discarded.inc()
            response = await self.ctx.send(url, content, attempt.send_headers)
        self.headed = time.perf_counter()
        if response.status_code >= 400:
            raise Rejected.of(response.status_code, await _read_closed(response))
        return response, b"" if self.stream else await _read_closed(response)

    def abandon(self) -> None:
        """Cancel the early request if no try took it."""
        if self.early is not None:
            self.early.cancel()
            self.early = None


def _answer(ctx: GatewayContext, session: Session, ended: TurnEnd[tuple[HttpAnswer, bytes]], stream: bool,
            waited_s: float) -> Reply:
    """The client's answer: the backend's (streamed through, or whole), its error in OpenAI's shape, or the
    gateway's own 502/504 when no backend could be reached or its answer was too large to take whole."""
    attempt, error = ended.attempt, ended.error
    answer = error.__cause__ if isinstance(error, (ContextOverflowError, PoolExhaustedError)) else error
    if isinstance(answer, Rejected):
        if answer.status_code not in RECOVERABLE:
            ctx.metrics.observe(attempt.decision.role, waited_s)
        return _upstream_error(ctx, attempt, answer.status_code, answer.raw)
    if isinstance(answer, HttpError) and answer.kind in ("outage", "timeout"):
        return _unreachable(ctx, attempt, answer)
    if isinstance(error, AnswerTooLarge):
        ctx.metrics.upstream_errors.labels(attempt.decision.role, "502").inc()
        emit("gateway.answer_too_large", level="warning", backend=attempt.decision.role, limit=error.limit)
        return own_error(502, str(error))
    response, raw = ended.result()
    ctx.metrics.observe(attempt.decision.role, waited_s)
    ctx.metrics.answered(attempt.decision.role, attempt.decision.reason)
    if stream:
        return _streamed(session, attempt, response)
    _record_later(session, attempt, raw)
    return Reply(response.status_code, raw, route_headers(attempt.decision), response.headers.get("content-type", JSON))


def _count_moves(ctx: GatewayContext, attempt: Attempt) -> None:
    """The turn's recoveries and failovers, in the gateway's metrics."""
    if attempt.turn.failovers:
        ctx.metrics.failovers.inc(attempt.turn.failovers)
    if attempt.turn.recoveries:
        ctx.metrics.overflows_recovered.inc(attempt.turn.recoveries)


def _record_later(session: Session, attempt: Attempt, answer: bytes | UsageWatch) -> None:
    """Have the Session record ``answer`` (a JSON answer's bytes, or a stream's usage watch) once it is on its way:
    by the event loop's next turn, which comes after the request's task has written its response (nothing on the
    request path waits for the Session's bookkeeping)."""
    asyncio.get_running_loop().call_soon(_record, session, attempt, answer)


def _record(session: Session, attempt: Attempt, answer: bytes | UsageWatch) -> None:
    """What the Session records of an answer (its usage); a failure is logged, never raised to the loop."""
    try:
        usage = answer.usage_chunk if isinstance(answer, UsageWatch) else _parsed(answer)
        session.answered(attempt, usage)
    except Exception as error:  # pragma: no cover - recording must never take a request down
        emit("gateway.record_failed", level="warning", error=type(error).__name__)


def _presend(ctx: GatewayContext, session: Session, body: dict[str, Any]) -> StartedPost | None:
    """The request written to fast before it is counted, when the Session vouches for it and a kept connection is
    idle (see :func:`relay`); else None."""
    attempt = session.presend(body)
    if attempt is None:
        return None
    started = ctx.upstream.start(attempt.url, attempt.content, attempt.send_headers)
    if started is not None:
        ctx.metrics.presends.inc()
    return started


def _parsed(raw: bytes) -> Any:
    """A JSON answer parsed for :meth:`Session.answered` (its ``usage``); ``{}`` when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return {}


async def _read_closed(response: HttpAnswer) -> bytes:
    try:
        return await response.aread()
    finally:
        await response.aclose()


def _upstream_error(ctx: GatewayContext, attempt: Attempt, status: int, raw: bytes) -> Reply:
    """A backend's error answer, in OpenAI's shape with its status, from the backend that produced it."""
    ctx.metrics.upstream_errors.labels(attempt.decision.role, str(status)).inc()
    emit("gateway.upstream_error", backend=attempt.decision.role, status=status, bytes=len(raw))
    return Reply(status, upstream_error_body(status, raw), route_headers(attempt.decision))


def _unreachable(ctx: GatewayContext, attempt: Attempt, error: HttpError) -> Reply:
    """No backend could be reached (or the last one timed out): 504 for a timeout, else 502."""
    status = 504 if error.kind == "timeout" else 502
    how = outage_cause(error) or error.kind
    ctx.metrics.upstream_errors.labels(attempt.decision.role, str(status)).inc()
    emit("gateway.unreachable", level="warning", backend=attempt.decision.role, error=how)
    return own_error(status, f"the {attempt.decision.role} backend could not be reached ({how})")


def _streamed(session: Session, attempt: Attempt, response: HttpAnswer) -> Reply:
    headers = {**route_headers(attempt.decision), "cache-control": "no-cache"}
    watch = UsageWatch()

    def finish() -> None:  # the stream is over (ended, cut, or never begun): close upstream, record the usage seen
        response.close()
        _record_later(session, attempt, watch)

    return Reply(response.status_code, headers=headers, content_type=response.headers.get(
        "content-type", "text/event-stream"), chunks=_passed_through(attempt, response, watch), finish=finish)


async def _passed_through(attempt: Attempt, response: HttpAnswer, watch: UsageWatch) -> AsyncIterator[bytes]:
    """The backend's SSE bytes as they arrive, each read by ``watch`` for the usage first. A client that leaves
    cancels the writer, which closes this generator and the upstream response (the backend then aborts)."""
    try:
        async for data in response.aiter_raw():
            watch.feed(data)
            yield data
    except HttpError as error:  # headers are sent: end with an error event, as vLLM's stream generators do
        how = outage_cause(error) or error.kind
        emit("gateway.stream_broken", level="warning", backend=attempt.decision.role, error=how)
        yield b"data: " + error_body(502, f"the backend's stream broke ({how})") + b"\n\n"
