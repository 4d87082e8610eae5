"""What each endpoint of the local server does, independent of sockets: a request in, a :class:`Reply` out.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (JSON or SSE), ``POST /tokenize``,
``GET /metrics``, ``GET /health``. Errors use vLLM's JSON; unknown paths answer as FastAPI does.
"""

from __future__ import annotations

import itertools

import json
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Protocol

from agentkv.events import emit
from agentkv.local import protocol
from agentkv.local.engine import Delta, Generation, LocalEngine
from agentkv.local.limits import check_length, error_body, resolve_max_tokens
from agentkv.local.metrics import render_metrics
from agentkv.local.protocol import ChatCall, ChatIds, RequestError


class Served(Protocol):
    """What the routes need from the server: the engine and how it is presented."""

    engine: LocalEngine
    created: int
    root: str

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    def record(self, method: str, path: str, body: Any) -> None: ...


@dataclass
class Reply:
    """An HTTP answer: a JSON ``body``, plain ``text``, or SSE ``events`` sent chunked."""

    status: int = 200
    body: Any = None
    text: str | None = None
    content_type: str = "application/json"
    events: Generator[bytes, None, None] | None = None

    def payload(self) -> bytes:
        """The encoded body of a non-streaming reply."""
        if self.text is not None:
            return self.text.encode()
        return json.dumps(self.body, ensure_ascii=False).encode()


def _check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.model_id:
        raise protocol.model_not_found(model)


def list_models(served: Served, body: Any) -> Reply:
    """``GET /v1/models``: the one served model and its window."""
    return Reply(body=protocol.models_list(served.model_id, served.root, served.max_model_len, served.created))


def chat_completions(served: Served, body: Any) -> Reply:
    """``POST /v1/chat/completions``: validate like vLLM, then answer in one piece or as SSE."""
    call = protocol.parse_chat(body)
    _check_model(served, call.model)
    engine = served.engine
    tokens = engine.encode_chat(call.chat)
    error = check_length(len(tokens), call.max_tokens, served.max_model_len, param=call.max_tokens_param)
    if error is not None:
        emit("local.request.rejected", model_id=served.model_id, prompt_tokens=len(tokens),
             max_tokens=call.max_tokens, max_model_len=served.max_model_len)
        return Reply(status=400, body=error.body())
    max_tokens = resolve_max_tokens(len(tokens), call.max_tokens, served.max_model_len)
    stream = engine.stream(tokens, max_tokens, cache_salt=call.cache_salt, temperature=call.temperature,
                           seed=call.seed)
    ids = ChatIds(served.model_id)
    if call.stream:
        return Reply(content_type="text/event-stream", events=_sse_events(ids, stream, call))
    return Reply(body=_whole(ids, stream, call))


def _usage(result: Generation) -> dict[str, Any]:
    return protocol.usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)


def _final(stream: Iterator[Delta | Generation]) -> Generation:
    for item in stream:
        if isinstance(item, Generation):
            return item
    raise RuntimeError("the engine's stream ended without a result")


def _whole(ids: ChatIds, stream: Iterator[Delta | Generation], call: ChatCall) -> dict[str, Any]:
    result = _final(stream)
    tools_enabled = bool(call.chat.tools) and call.chat.tool_choice != "none"
    return protocol.completion(ids, result.text, result.finish_reason, _usage(result), tools_enabled)


def _sse_events(ids: ChatIds, stream: Iterator[Delta | Generation], call: ChatCall
                ) -> Generator[bytes, None, None]:
    """The SSE body: a role chunk, content chunks, a finish chunk, the usage chunk if asked, ``[DONE]``.

    As in vLLM, the first chunk leaves only once the prompt is prefilled and a first token exists, so
    time-to-first-chunk measures prefill.
    """
    try:
        first = next(stream)
        yield protocol.sse(protocol.chunk(ids, {"role": "assistant", "content": ""}))
        result = None
        for item in itertools.chain([first], stream):
            if isinstance(item, Generation):
                result = item
            elif item.text:
                yield protocol.sse(protocol.chunk(ids, {"content": item.text}))
        assert result is not None
        yield protocol.sse(protocol.chunk(ids, {}, result.finish_reason))
        if call.include_usage:
            yield protocol.sse(protocol.usage_chunk(ids, _usage(result)))
        yield protocol.sse("[DONE]")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


def tokenize(served: Served, body: Any) -> Reply:
    """``POST /tokenize``: the chat form counts exactly what the chat endpoint prefills."""
    call = protocol.parse_tokenize(body)
    _check_model(served, call.model)
    engine = served.engine
    if call.chat is not None:
        tokens = engine.encode_chat(call.chat, add_special_tokens=call.add_special_tokens)
    else:
        tokens = engine.tokenize_prompt(call.prompt, add_special_tokens=call.add_special_tokens)
    strs = engine.codec.token_strs(tokens) if call.return_token_strs else None
    return Reply(body=protocol.tokenize_result(tokens, served.max_model_len, strs))


def metrics(served: Served, body: Any) -> Reply:
    """``GET /metrics``: Prometheus text under vLLM's metric names."""
    text = render_metrics(served.engine.stats(), served.model_id)
    return Reply(text=text, content_type="text/plain; version=0.0.4; charset=utf-8")


def health(served: Served, body: Any) -> Reply:
    """``GET /health``: 200 with an empty body, as vLLM answers."""
    return Reply(text="", content_type="text/plain")


Route = Callable[[Served, Any], Reply]

ROUTES: dict[str, dict[str, Route]] = {
    "/v1/models": {"GET": list_models},
    "/v1/chat/completions": {"POST": chat_completions},
    "/tokenize": {"POST": tokenize},
    "/metrics": {"GET": metrics},
    "/health": {"GET": health},
}


def _parse_body(raw: bytes) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"Invalid JSON in request body: {exc}") from exc


def handle(served: Served, method: str, path: str, raw: bytes) -> Reply:
    """Answer one request; every failure becomes vLLM's (or FastAPI's) error JSON."""
    methods = ROUTES.get(path.rstrip("/") or "/")
    if methods is None:
        return Reply(status=404, body={"detail": "Not Found"})
    route = methods.get(method)
    if route is None:
        return Reply(status=405, body={"detail": "Method Not Allowed"})
    try:
        body = _parse_body(raw)
    except RequestError as exc:
        served.record(method, path, None)
        return Reply(status=exc.status, body=exc.body)
    served.record(method, path, body)
    try:
        return route(served, body)
    except RequestError as exc:
        return Reply(status=exc.status, body=exc.body)
    except Exception as exc:  # a bug or an engine failure: answer 500 instead of dropping the connection
        emit("local.request.failed", level="exception", path=path, error=type(exc).__name__)
        return Reply(status=500, body=error_body(str(exc), type="InternalServerError", code=500))
