"""The OpenAI SDK (and everything built on it): httpx transports that route each chat completion.

    import httpx, openai
    from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport

    client = openai.OpenAI(base_url=fast.api_base, api_key="-",
                           http_client=httpx.Client(transport=AgentKVTransport(session)))
    client.chat.completions.create(model=fast_model_id, messages=messages, tools=tools)

The same one line serves ``langchain_openai.ChatOpenAI(http_client=..., http_async_client=...)``, the
Agents SDK's ``AsyncOpenAI``, and pydantic-ai's OpenAI provider. For ``POST …/chat/completions`` the
transport reads the raw body and, through the Session's public core (:meth:`Session.prepare`,
:meth:`Session.recover`, :meth:`Session.answered`): counts it as sent, routes it (rewriting the URL and
``model`` to the slow backend's), clamps the output budget, sets the tenant's ``cache_salt``, fires
the warm-ahead with the same body (one-token budget, no stream), re-sends to slow when fast answers
with a context-overflow 400 (JSON and streaming requests alike: the caller sees one response), and
records usage and cached tokens from the JSON answer or from a stream's usage chunk (sent when the
caller asks for ``stream_options.include_usage``). Every other request passes through untouched.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Mapping

import httpx

from agentkv._session.attempts import Attempt
from agentkv.errors import ContextOverflowError
from agentkv.tenancy import with_body_salt
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv._session.driver import Session

__all__ = ["AgentKVTransport", "AsyncAgentKVTransport"]

_REJECTED = (400, 413)
_NOT_COUNTED = ("stream", "stream_options")


class Rejected(Exception):
    """A backend's 4xx answer, shaped like the SDK's ``BadRequestError`` for the overflow parser."""

    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(text)
        self.status_code = status_code
        self.message = text


# ----------------------------------------------------------------------------- pure helpers
def is_chat_completion(request: httpx.Request) -> bool:
    """True for the requests the transport routes: ``POST …/chat/completions``."""
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/chat/completions")


def counted_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the Session counts and warms: the body without its streaming switches."""
    return {k: v for k, v in body.items() if k not in _NOT_COUNTED}


def outgoing_body(body: Mapping[str, Any], attempt: Attempt, salt: str | None) -> dict[str, Any]:
    """The body for this try: the slow model's id when routed there, the clamped budget, the tenant's salt
    (replacing the caller's: :func:`agentkv.tenancy.with_body_salt`)."""
    out = dict(body)
    if attempt.decision.role == "slow":
        out["model"] = attempt.backend.served_model
    budget = attempt.decision.max_tokens
    if budget is not None:
        keys = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None] or ["max_tokens"]
        out.update({key: budget for key in keys})
    return with_body_salt(out, salt if attempt.backend.api_base else None, keep_caller=attempt.keeps_caller_salt)


def outgoing_request(request: httpx.Request, body: Mapping[str, Any], attempt: Attempt,
                     salt: str | None) -> httpx.Request:
    """``request`` re-addressed to the attempt's backend (its ``api_base``) carrying this try's body."""
    url = request.url
    if attempt.decision.role == "slow" and attempt.backend.api_base:
        url = httpx.URL(attempt.backend.api_base.rstrip("/") + "/chat/completions", params=request.url.params)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
    if attempt.decision.role == "slow" and attempt.backend.api_key:
        headers["authorization"] = f"Bearer {attempt.backend.api_key}"
    content = json.dumps(outgoing_body(body, attempt, salt)).encode()
    return httpx.Request("POST", url, headers=headers, content=content, extensions=request.extensions)


def refused(error: ContextOverflowError) -> httpx.Response:
    """A vLLM-shaped 400 for a request no backend can hold (nothing was sent)."""
    return json_response(400, {"object": "error", "message": str(error), "type": "BadRequestError",
                               "param": None, "code": 400})


def json_response(status_code: int, answer: Any, extensions: Mapping[str, Any] | None = None) -> httpx.Response:
    """A JSON answer as a transport returns one: an unread stream with its content headers."""
    raw = json.dumps(answer).encode()
    headers = {"content-type": "application/json", "content-length": str(len(raw))}
    return httpx.Response(status_code, headers=headers, stream=httpx.ByteStream(raw), extensions=extensions)


def replayed(response: httpx.Response, raw: bytes) -> httpx.Response:
    """A response already read to its last byte, handed on as it came (a stream, as transports answer)."""
    return httpx.Response(response.status_code, headers=response.headers, stream=httpx.ByteStream(raw),
                          extensions=response.extensions)


def json_answer(response: httpx.Response, raw: bytes) -> Any:
    """The parsed JSON of a raw (possibly content-encoded) answer, or None when it is not JSON."""
    try:
        return httpx.Response(response.status_code, headers=response.headers, content=raw).json()
    except ValueError:
        return None


class UsageWatch:
    """Reads SSE lines as they pass and keeps the last chunk that carries ``usage``."""

    def __init__(self) -> None:
        self._pending = b""
        self.usage_chunk: dict[str, Any] = {}

    def feed(self, data: bytes) -> None:
        """Take the next raw bytes of the stream."""
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._line(line.strip())

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            return
        if isinstance(chunk, dict) and chunk.get("usage"):
            self.usage_chunk = chunk


# ----------------------------------------------------------------------------- the streams
class _SyncStream(httpx.SyncByteStream):
    """The backend's SSE bytes, unchanged; usage recorded when the stream ends or is closed."""

    def __init__(self, inner: httpx.SyncByteStream, finish: Any) -> None:
        self._inner, self._finish, self._watch, self._done = inner, finish, UsageWatch(), False

    def __iter__(self) -> Iterator[bytes]:
        for data in self._inner:
            self._watch.feed(data)
            yield data
        self._end()

    def close(self) -> None:
        self._inner.close()
        self._end()

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._finish(self._watch.usage_chunk)


class _AsyncStream(httpx.AsyncByteStream):
    """The async twin of :class:`_SyncStream`."""

    def __init__(self, inner: httpx.AsyncByteStream, finish: Any) -> None:
        self._inner, self._finish, self._watch, self._done = inner, finish, UsageWatch(), False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self._inner:
            self._watch.feed(data)
            yield data
        self._end()

    async def aclose(self) -> None:
        await self._inner.aclose()
        self._end()

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._finish(self._watch.usage_chunk)


# ----------------------------------------------------------------------------- the transports
class AgentKVTransport(httpx.BaseTransport):
    """An httpx transport routing an OpenAI-SDK client's chat completions through ``session``.

    ``inner`` sends the requests (a pooled ``httpx.HTTPTransport`` by default).
    """

    def __init__(self, session: "Session", inner: httpx.BaseTransport | None = None) -> None:
        self.session = session
        self._inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not is_chat_completion(request):
            return self._inner.handle_request(request)
        body = json.loads(request.read())
        try:
            attempt = self.session.prepare(counted_view(body))
        except ContextOverflowError as error:
            return refused(error)
        while True:
            response = self._inner.handle_request(outgoing_request(request, body, attempt, self.session.cache_salt))
            if response.status_code not in _REJECTED:
                return self._answered(attempt, response, bool(body.get("stream")))
            raw = b"".join(response.iter_raw())
            response.close()
            try:
                attempt = self.session.recover(attempt, Rejected(response.status_code, raw.decode("utf-8", "replace")))
            except (Rejected, ContextOverflowError):
                return replayed(response, raw)

    def _answered(self, attempt: Attempt, response: httpx.Response, stream: bool) -> httpx.Response:
        if response.status_code >= 400:
            return response
        if stream:
            assert isinstance(response.stream, httpx.SyncByteStream)
            wrapped = _SyncStream(response.stream, lambda usage: self.session.answered(attempt, usage))
            return httpx.Response(response.status_code, headers=response.headers, stream=wrapped,
                                  extensions=response.extensions)
        raw = b"".join(response.iter_raw())
        response.close()
        self.session.answered(attempt, json_answer(response, raw) or {})
        return replayed(response, raw)

    def close(self) -> None:
        self._inner.close()


class AsyncAgentKVTransport(httpx.AsyncBaseTransport):
    """The async twin of :class:`AgentKVTransport` (counts over async HTTP; warms run as tasks)."""

    def __init__(self, session: "Session", inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.session = session
        self._inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not is_chat_completion(request):
            return await self._inner.handle_async_request(request)
        body = json.loads(await request.aread())
        try:
            attempt = await self.session.aprepare(counted_view(body))
        except ContextOverflowError as refusal:
            return refused(refusal)
        while True:
            sent = outgoing_request(request, body, attempt, self.session.cache_salt)
            response = await self._inner.handle_async_request(sent)
            if response.status_code not in _REJECTED:
                return await self._answered(attempt, response, bool(body.get("stream")))
            raw = b"".join([part async for part in response.aiter_raw()])
            await response.aclose()
            try:
                rejection = Rejected(response.status_code, raw.decode("utf-8", "replace"))
                attempt = await self.session.arecover(attempt, rejection)
            except (Rejected, ContextOverflowError):
                return replayed(response, raw)

    async def _answered(self, attempt: Attempt, response: httpx.Response, stream: bool) -> httpx.Response:
        if response.status_code >= 400:
            return response
        if stream:
            assert isinstance(response.stream, httpx.AsyncByteStream)
            wrapped = _AsyncStream(response.stream,
                                   lambda usage: self.session.answered(attempt, usage, asynchronous=True))
            return httpx.Response(response.status_code, headers=response.headers, stream=wrapped,
                                  extensions=response.extensions)
        raw = b"".join([part async for part in response.aiter_raw()])
        await response.aclose()
        self.session.answered(attempt, json_answer(response, raw) or {}, asynchronous=True)
        return replayed(response, raw)

    async def aclose(self) -> None:
        await self._inner.aclose()
