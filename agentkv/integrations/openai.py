"""The OpenAI SDK (and everything built on it): httpx transports that route each chat completion.

    import httpx, openai
    from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport

    client = openai.OpenAI(base_url=fast.api_base, api_key="-",
                           http_client=httpx.Client(transport=AgentKVTransport(session)))
    client.chat.completions.create(model=fast_model_id, messages=messages, tools=tools)

A client built once for many conversations takes a :class:`~agentkv.Conversations` instead of the Session:
``AgentKVTransport(conversations)``. Each chat completion then goes through its conversation's Session: the one its
``X-Session-ID`` header names (or a header under one of the backends' ``affinity_headers``), else its body's ``user``,
else its opening's fingerprint; under the tenant ``tenant_of`` finds for the ``httpx.Request`` (say, from its API key),
never under one the request names.

The same one line serves ``langchain_openai.ChatOpenAI(http_client=..., http_async_client=...)``, the
Agents SDK's ``AsyncOpenAI``, and pydantic-ai's OpenAI provider. For ``POST …/chat/completions`` the
transport reads the raw body and, through the Session's public core (:meth:`Session.prepare`,
:meth:`Session.turn`, :meth:`Session.answered`): counts it as sent, routes it (rewriting the URL and
``model`` to the slow backend's), clamps the output budget, sets the tenant's ``cache_salt``, fires
the warm-ahead with the same body (one-token budget, no stream), re-sends to slow when fast answers
with a context-overflow 400 (JSON and streaming requests alike: the caller sees one response), and
records usage and cached tokens from the JSON answer or from a stream's usage chunk (sent when the
caller asks for ``stream_options.include_usage``). Every other request passes through untouched.

Retries and failover are the Session's (:class:`~agentkv.RetryPolicy`): 429/5xx/connection errors are retried,
an outage (refused, dropped, incomplete, 502/503/504) fails over to the other backend, at most ``attempts`` tries
per backend in a turn. The caller's SDK does not retry on top: the final error answer carries
``x-should-retry: false``, and a connection error with no try left is raised as the SDK's own
``APIConnectionError`` (``APITimeoutError``), which openai >= 2 does not retry. A stream that breaks before its
first bytes is retried like any outage; one that breaks after them raises :class:`StreamBrokenError`, and is
never re-sent.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import httpx

from agentkv._session import Attempt, TurnEnd
from agentkv.conversations import Conversations, session_of
from agentkv.errors import AgentKVError, ConfigurationError, ContextOverflowError, PoolExhaustedError
from agentkv.retry import outage_cause
from agentkv.wire.openai import Rejected, UsageWatch

if TYPE_CHECKING:
    from agentkv._session import Session

__all__ = ["AgentKVTransport", "AsyncAgentKVTransport", "StreamBrokenError"]

class StreamBrokenError(AgentKVError, ConnectionError):
    """A streamed answer broke after its first bytes reached the caller. It is never re-sent (the caller holds
    a partial answer, and a second one would not continue it): send the turn again to retry it. Raised from the
    transport's error, and not as an httpx error, so the OpenAI SDK hands it to the caller as it is."""

    partial_answer = True  # never an outage (agentkv.retry.outage_cause): nothing fails over from it


# ----------------------------------------------------------------------------- pure helpers
def is_chat_completion(request: httpx.Request) -> bool:
    """True for the requests the transport routes: ``POST …/chat/completions``."""
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/chat/completions")


def conversation_header(request: httpx.Request, target: "Session | Conversations") -> str | None:
    """The conversation the request names: its ``X-Session-ID`` header, else a header under one of the backends'
    ``affinity_headers`` (None without one)."""
    names = ["X-Session-ID", *(n for b in (target.fast, target.slow) if b is not None for n in b.affinity_headers)]
    return next((request.headers[n] for n in names if request.headers.get(n)), None)


def session_for(target: "Session | Conversations", request: httpx.Request, body: Mapping[str, Any]) -> "Session":
    """The Session this request goes through: ``target``, or its conversation's when ``target`` is a Conversations."""
    return session_of(target, conversation=conversation_header(request, target), body=body, request=request)


def check_addressable(session: "Session | Conversations") -> None:
    """The transport re-sends the client's OpenAI body to the backend's own URL: a :class:`ConfigurationError` unless
    each backend is an OpenAI-compatible server or OpenAI's API, slow with an ``api_base`` (a slow try without one
    would go where the client sent the fast one, with slow's key)."""
    for backend in (session.fast, session.slow):
        if backend is None:
            continue
        if backend.provider_kind not in ("vllm", "openai"):
            raise ConfigurationError(
                f"backend {backend.label!r} is a {backend.provider_kind} model: the OpenAI-SDK transport sends OpenAI "
                "bodies as they are, to OpenAI-compatible servers and OpenAI only; send through Session.completion, "
                "which reaches it through litellm's provider code")
        if not backend.api_base and backend is session.slow:
            raise ConfigurationError(
                f"backend {backend.label!r} has no api_base: the transport sends a slow try to the backend's URL "
                "(OpenAI's is api_base='https://api.openai.com/v1')")


def outgoing_request(request: httpx.Request, body: Mapping[str, Any], attempt: Attempt, *,
                     pooled: bool = False) -> httpx.Request:
    """``request`` re-addressed to the attempt's backend (its ``api_base``: slow's, or a pool's replica for this
    conversation) carrying this try's body and the conversation's routing key (a session header the caller set
    wins). A fast try goes where the client sent it unless fast is a pool (``pooled``)."""
    url = request.url
    if attempt.backend.api_base and (attempt.decision.role == "slow" or pooled):
        url = httpx.URL(attempt.url, params=request.url.params)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
    taken = {k.lower() for k in headers}
    headers.update({k: v for k, v in attempt.send_headers.items() if k.lower() not in taken})
    if attempt.decision.role == "slow" and attempt.backend.api_key:
        headers["authorization"] = f"Bearer {attempt.backend.api_key}"
    content = attempt.content
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


def final(response: httpx.Response) -> httpx.Response:
    """``response`` marked so that the OpenAI SDK does not retry it: the transport's retries were the bound."""
    response.headers["x-should-retry"] = "false"
    return response


def replayed(response: httpx.Response, raw: bytes) -> httpx.Response:
    """A response already read to its last byte, handed on as it came (a stream, as transports answer)."""
    return httpx.Response(response.status_code, headers=response.headers, stream=httpx.ByteStream(raw),
                          extensions=response.extensions)


def json_answer(response: httpx.Response, raw: bytes) -> Any:
    """The parsed JSON of a raw (possibly content-encoded) answer, or None when it is not JSON (or nested too deep
    to parse: the answer still reaches the caller as it came)."""
    try:
        return httpx.Response(response.status_code, headers=response.headers, content=raw).json()
    except (ValueError, RecursionError):
        return None


@dataclass
class Sent:
    """One try's answer as the transport holds it: a JSON answer read whole (``raw``), or a stream whose first
    bytes were read (``first``, then ``chunks``): a stream that breaks before them is retried like any outage."""

    response: httpx.Response
    raw: bytes = b""
    first: bytes = b""
    chunks: Any = None


def replay(rejected: Rejected) -> httpx.Response:
    """A backend's error answer as the caller's client gets it: as it came, marked final (``x-should-retry: false``)."""
    assert rejected.response is not None
    return final(replayed(rejected.response, rejected.raw))


def broken(error: BaseException, backend: str, received: int) -> StreamBrokenError:
    return StreamBrokenError(
        f"the streamed answer from {backend!r} broke after {received} bytes ({type(error).__name__}: {error}); "
        "agentkv never re-sends a stream once its first bytes reached the caller, who holds a partial answer: "
        "send the turn again to retry it")


def gave_up(request: httpx.Request, error: Exception) -> Exception:
    """The error to raise when no try is left. Under the OpenAI SDK (its ``x-stainless-retry-count`` header), the
    SDK's own ``APIConnectionError``/``APITimeoutError`` raised from ``error``: openai >= 2 propagates an
    ``OpenAIError`` from its transport without retrying it, so its ``max_retries`` never multiplies the policy's."""
    if "x-stainless-retry-count" not in request.headers or not isinstance(error, httpx.TransportError):
        return error  # not under the SDK, or not an error it would have wrapped (and retried) itself
    try:
        import openai
    except ImportError:
        return error
    if outage_cause(error) == "timeout":
        wrapped: Exception = openai.APITimeoutError(request=request)  # type: ignore[arg-type]
    else:
        wrapped = openai.APIConnectionError(message=f"Connection error: {type(error).__name__}: {error}",
                                            request=request)  # type: ignore[arg-type]
    wrapped.__cause__ = error
    return wrapped


# ----------------------------------------------------------------------------- the streams
class _Watched:
    """What both stream twins keep: the usage watch, the bytes received, and the one call of ``finish``."""

    def __init__(self, sent: Sent, finish: Any, backend: str) -> None:
        self._sent, self._finish, self._backend = sent, finish, backend
        self._watch, self._done, self._received = UsageWatch(), False, 0

    def _take(self, data: bytes) -> bytes:
        self._received += len(data)
        self._watch.feed(data)
        return data

    def _broken(self, error: BaseException) -> StreamBrokenError:
        return broken(error, self._backend, self._received)

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._finish(self._watch.usage_chunk)


class _SyncStream(_Watched, httpx.SyncByteStream):
    """The backend's SSE bytes, unchanged; usage recorded when the stream ends or is closed. A stream that breaks
    after its first bytes raises :class:`StreamBrokenError` (never re-sent)."""

    def __iter__(self) -> Iterator[bytes]:
        try:
            for data in itertools.chain([self._sent.first] if self._sent.first else [], self._sent.chunks):
                yield self._take(data)
        except (httpx.TransportError, OSError) as error:
            raise self._broken(error) from error
        self._end()

    def close(self) -> None:
        self._sent.response.close()
        self._end()


class _AsyncStream(_Watched, httpx.AsyncByteStream):
    """The async twin of :class:`_SyncStream`."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            if self._sent.first:
                yield self._take(self._sent.first)
            async for data in self._sent.chunks:
                yield self._take(data)
        except (httpx.TransportError, OSError) as error:
            raise self._broken(error) from error
        self._end()

    async def aclose(self) -> None:
        await self._sent.response.aclose()
        self._end()


def _answered(session: "Session", request: httpx.Request, ended: TurnEnd[Sent], stream: bool,
              kind: type[_SyncStream] | type[_AsyncStream]) -> httpx.Response:
    """The answer handed to the caller's client: a stream wrapped to record its usage at its end, or the JSON answer
    recorded now and replayed; the turn's last word when it got no answer (:func:`_last_word`)."""
    if ended.error is not None:
        return _last_word(request, ended.error)
    attempt, sent = ended.attempt, ended.result()
    response = sent.response
    if not stream:
        session.answered(attempt, json_answer(response, sent.raw) or {})
        return replayed(response, sent.raw)
    wrapped = kind(sent, lambda usage: session.answered(attempt, usage),
                   attempt.backend.label)
    return httpx.Response(response.status_code, headers=response.headers, stream=wrapped,
                          extensions=response.extensions)


# ----------------------------------------------------------------------------- the transports
class AgentKVTransport(httpx.BaseTransport):
    """An httpx transport routing an OpenAI-SDK client's chat completions through ``session`` (a Session, or a
    :class:`~agentkv.Conversations`: each request through its conversation's Session).

    ``inner`` sends the requests (a pooled ``httpx.HTTPTransport`` by default). Each try is retried and failed
    over under the Session's :class:`~agentkv.RetryPolicy` (at most ``attempts`` tries per backend in a turn);
    the answer the caller's client finally gets is marked ``x-should-retry: false`` and an error with no try
    left is raised as the SDK's own, so the SDK's ``max_retries`` never multiplies the policy's.
    """

    def __init__(self, session: "Session | Conversations", inner: httpx.BaseTransport | None = None) -> None:
        check_addressable(session)
        self.session = session
        self._inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not is_chat_completion(request):
            return self._inner.handle_request(request)
        body = json.loads(request.read())
        session = session_for(self.session, request, body)
        try:
            attempt = session.prepare(body, headers=request.headers)
        except ContextOverflowError as error:
            return refused(error)
        stream = bool(body.get("stream"))
        ended = session.turn(attempt, lambda a: self._once(self._outgoing(request, body, a), stream), streamed=stream)
        return _answered(session, request, ended, stream, _SyncStream)

    def _outgoing(self, request: httpx.Request, body: Mapping[str, Any], attempt: Attempt) -> httpx.Request:
        return outgoing_request(request, body, attempt, pooled=self.session.fast.is_pool)

    def _once(self, request: httpx.Request, stream: bool) -> Sent:
        response = self._inner.handle_request(request)
        try:
            if response.status_code >= 400 or not stream:
                raw = b"".join(response.iter_raw())  # an incomplete answer raises here: retried, failed over
                response.close()
                if response.status_code >= 400:
                    raise Rejected.of(response.status_code, raw, response)
                return Sent(response, raw=raw)
            assert isinstance(response.stream, httpx.SyncByteStream)
            chunks = iter(response.stream)
            return Sent(response, first=next(chunks, b""), chunks=chunks)  # a break before the first bytes: retried
        except BaseException:
            response.close()
            raise

    def close(self) -> None:
        self._inner.close()


class AsyncAgentKVTransport(httpx.AsyncBaseTransport):
    """The async twin of :class:`AgentKVTransport` (counts over async HTTP; warms run as tasks)."""

    def __init__(self, session: "Session | Conversations", inner: httpx.AsyncBaseTransport | None = None) -> None:
        check_addressable(session)
        self.session = session
        self._inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not is_chat_completion(request):
            return await self._inner.handle_async_request(request)
        body = json.loads(await request.aread())
        session = session_for(self.session, request, body)
        try:
            attempt = await session.aprepare(body, headers=request.headers)
        except ContextOverflowError as refusal:
            return refused(refusal)
        stream = bool(body.get("stream"))
        ended = await session.aturn(attempt, lambda a: self._once(self._outgoing(request, body, a), stream),
                                    streamed=stream)
        return _answered(session, request, ended, stream, _AsyncStream)

    def _outgoing(self, request: httpx.Request, body: Mapping[str, Any], attempt: Attempt) -> httpx.Request:
        return outgoing_request(request, body, attempt, pooled=self.session.fast.is_pool)

    async def _once(self, request: httpx.Request, stream: bool) -> Sent:
        response = await self._inner.handle_async_request(request)
        try:
            if response.status_code >= 400 or not stream:
                raw = b"".join([part async for part in response.aiter_raw()])
                await response.aclose()
                if response.status_code >= 400:
                    raise Rejected.of(response.status_code, raw, response)
                return Sent(response, raw=raw)
            assert isinstance(response.stream, httpx.AsyncByteStream)
            chunks = aiter(response.stream)
            return Sent(response, first=await anext(chunks, b""), chunks=chunks)
        except BaseException:
            await response.aclose()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


def _last_word(request: httpx.Request, error: Exception) -> httpx.Response:
    """What the caller's client gets when the turn ended with ``error``: the backend's last answer (also when the
    Session gave up on an overflow it answered), or ``error`` raised as the client's own final error."""
    answer = error.__cause__ if isinstance(error, (ContextOverflowError, PoolExhaustedError)) else error
    if isinstance(answer, Rejected) and answer.response is not None:
        return replay(answer)
    if isinstance(error, PoolExhaustedError) and isinstance(answer, httpx.TransportError):
        error = answer  # an httpx client expects a transport's own errors (the pool_exhausted event names the states)
    wrapped = gave_up(request, error)
    if wrapped is error:
        raise error
    raise wrapped from error
