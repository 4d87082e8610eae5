"""What each endpoint of the local server does, independent of sockets: a request in, a :class:`RouteAnswer` out.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``/v1/completions`` (JSON or SSE),
``POST /invocations``, ``POST /tokenize`` and ``/detokenize``, ``GET /metrics``, ``/health``, ``/ping``,
``/version``, ``/load``, ``/tokenizer_info``. Errors use vLLM's JSON; unknown paths answer as FastAPI does.

A generating answer is deferred: :attr:`RouteAnswer.work` (a whole response) or :attr:`RouteAnswer.events` (SSE)
run in a worker thread of the socket layer (:mod:`agentkv.embedded.server.asgi`, which writes it as an
:class:`agentkv.http.asgi.Reply`), which sets :attr:`RouteAnswer.abort` when the client goes away; the engine then
stops the request at its next step and frees its KV.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterator, Mapping

from agentkv.events import emit
from agentkv.embedded.engine.codec import ChatRequest
from agentkv.embedded.engine.limits import error_body
from agentkv.embedded.server import protocol
from agentkv.embedded.server.chat import ChatPlan, chat_events, chat_whole, plan_chat
from agentkv.embedded.server.completions import completion_events, completion_whole, plan_completion
from agentkv.embedded.server.request_errors import UNPARSABLE_BODY, RequestError, validation_error
from agentkv.embedded.server.requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse
from agentkv.embedded.server.served import Served
from agentkv.embedded.server.validation import check_token_ids


@dataclass
class RouteAnswer:
    """What a route answers, before it is encoded: its status and a JSON ``body``, plain ``text``, deferred ``work``
    giving a body, or SSE ``events``; ``abort`` is set when the client goes away."""

    status: int = 200
    body: Any = None
    text: str | None = None
    content_type: str = "application/json"
    events: Iterator[bytes] | None = None
    work: Callable[[], Any] | None = None
    abort: threading.Event = field(default_factory=threading.Event)

    def finish(self) -> RouteAnswer:
        """Run deferred ``work`` (in the caller's thread) into ``body``; errors become their JSON."""
        if self.work is not None:
            work, self.work = self.work, None
            try:
                self.body = work()
            except RequestError as exc:
                self.status, self.body = exc.status, exc.body
            except Exception as exc:  # a bug or an engine failure: answer 500 instead of dropping the connection
                emit("local.request.failed", level="exception", error=type(exc).__name__)
                self.status, self.body = 500, error_body(str(exc), type="InternalServerError", code=500)
        return self

    def payload(self) -> bytes:
        """The encoded body of a non-streaming reply."""
        self.finish()
        if self.text is not None:
            return self.text.encode()
        return json.dumps(self.body, ensure_ascii=False).encode()


def _check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.model_id:
        raise protocol.model_not_found(model, served.model_id)


def list_models(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``GET /v1/models``: the one served model and its window."""
    reply.body = protocol.models_list(served.model_id, served.root, served.max_model_len, served.created)
    return reply


def _deliver(served: Served, plan: Any, reply: RouteAnswer, stream: bool, events: Callable[..., Iterator[bytes]],
             whole: Callable[..., Any]) -> RouteAnswer:
    served.observe_params(plan.n, plan.max_tokens)
    if stream:
        reply.content_type = "text/event-stream"
        reply.events = events(served, plan, reply.abort)
    else:
        reply.work = lambda: whole(served, plan, reply.abort)
    return reply


def chat_completions(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``POST /v1/chat/completions``: validate like vLLM, then answer in one piece or as SSE."""
    request = parse(ChatCompletionRequest, body)
    _check_model(served, request.model)
    plan: ChatPlan = plan_chat(served, request)
    return _deliver(served, plan, reply, bool(request.stream), chat_events, chat_whole)


def completions(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``POST /v1/completions``: prompts (text or ids), ``echo``, logprobs, ``n``."""
    request = parse(CompletionRequest, body)
    _check_model(served, request.model)
    plan = plan_completion(served, request)
    return _deliver(served, plan, reply, bool(request.stream), completion_events, completion_whole)


def invocations(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``POST /invocations`` (SageMaker): a chat body goes to chat, a prompt body to completions."""
    if isinstance(body, dict) and "messages" in body:
        return chat_completions(served, body, reply)
    if isinstance(body, dict) and "prompt" in body:
        return completions(served, body, reply)
    raise RequestError("Cannot determine the request type: send `messages` (chat) or `prompt` (completions).")


def tokenize(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``POST /tokenize``: the chat form counts exactly what the chat endpoint prefills."""
    request = parse(TokenizeRequest, body)
    _check_model(served, request.model)
    engine = served.engine
    if request.messages is not None:
        if not request.messages:
            raise RequestError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        chat = ChatRequest([m.model_dump(exclude_none=True) for m in request.messages],
                           [t.model_dump(exclude_none=True) for t in request.tools or []] or None, None,
                           request.add_generation_prompt, request.continue_final_message,
                           dict(request.chat_template_kwargs or {}))
        special = bool(request.add_special_tokens) if request.add_special_tokens is not None else False
        tokens = engine.encode_chat(chat, add_special_tokens=special)
    else:
        special = request.add_special_tokens if request.add_special_tokens is not None else True
        tokens = engine.tokenize_prompt(request.prompt or "", add_special_tokens=special)
    strs = engine.codec.token_strs(tokens) if request.return_token_strs else None
    reply.body = protocol.tokenize_result(tokens, served.max_model_len, strs)
    return reply


def detokenize(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``POST /detokenize``: token ids back to text."""
    request = parse(DetokenizeRequest, body)
    _check_model(served, request.model)
    check_token_ids(request.tokens, served.engine.vocab_size, "tokens")
    reply.body = {"prompt": served.engine.decode(request.tokens)}
    return reply


def metrics(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``GET /metrics``: Prometheus text under vLLM's metric names."""
    reply.text, reply.content_type = served.metrics_text(), "text/plain; version=0.0.4; charset=utf-8"
    return reply


def health(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``GET /health`` (and ``/ping``): 200 with an empty body, as vLLM answers."""
    reply.text, reply.content_type = "", "text/plain"
    return reply


def tokenizer_info(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``GET /tokenizer_info``: the tokenizer's class, special tokens, window and chat template."""
    codec = served.engine.codec
    tokenizer = getattr(codec, "tokenizer", None)
    eos = sorted(codec.eos_token_ids)
    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else "TiktokenTokenizer",
        "eos_token": codec.token_strs(eos[:1])[0] if eos else None,
        "model_max_length": served.max_model_len,
        "chat_template": getattr(tokenizer, "chat_template", None) or getattr(codec, "template", None)
        or _default_template(),
        "added_tokens_decoder": {str(i): {"content": codec.token_strs([i])[0], "special": True} for i in eos},
    }
    reply.body = info
    return reply


def _default_template() -> str:
    from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE

    return CHATML_TOOLS_TEMPLATE


def load(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``GET /load``: requests in flight (running or waiting), as vLLM's server-load tracking reports."""
    stats = served.engine.stats()
    reply.body = {"server_load": stats.running + stats.waiting}
    return reply


def version(served: Served, body: Any, reply: RouteAnswer) -> RouteAnswer:
    """``GET /version``: the server's version."""
    try:
        reply.body = {"version": metadata.version("agentkv")}
    except metadata.PackageNotFoundError:
        reply.body = {"version": "0.0.0"}
    return reply


Route = Callable[[Served, Any, RouteAnswer], RouteAnswer]

ROUTES: dict[str, dict[str, Route]] = {
    "/v1/models": {"GET": list_models},
    "/v1/chat/completions": {"POST": chat_completions},
    "/v1/completions": {"POST": completions},
    "/invocations": {"POST": invocations},
    "/tokenize": {"POST": tokenize},
    "/detokenize": {"POST": detokenize},
    "/metrics": {"GET": metrics},
    "/health": {"GET": health},
    "/ping": {"GET": health, "POST": health},
    "/version": {"GET": version},
    "/load": {"GET": load},
    "/tokenizer_info": {"GET": tokenizer_info},
}

_JSON_BODY = {"/v1/chat/completions", "/v1/completions", "/invocations", "/tokenize", "/detokenize"}


def _parse_body(raw: bytes) -> Any:
    """The JSON body (None when empty); a syntax error or a nesting too deep to parse is a 400, as FastAPI's."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise validation_error([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                 "input": {}, "ctx": {"error": exc.msg}}]) from None
    except (ValueError, RecursionError):  # not UTF-8, or nested past the recursion limit: never a 500
        raise RequestError("There was an error parsing the body", body=UNPARSABLE_BODY) from None


def _check_content_type(path: str, content_type: str | None) -> None:
    """vLLM accepts only ``application/json`` bodies on its JSON endpoints (400 otherwise)."""
    if content_type is None or path not in _JSON_BODY:
        return
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])


def handle(served: Served, method: str, path: str, raw: bytes, content_type: str | None = None,
           headers: Mapping[str, str] | None = None) -> RouteAnswer:
    """Answer one request; every failure becomes vLLM's (or FastAPI's) error JSON.

    ``content_type`` None skips the media-type check (for in-process callers that send JSON bytes); ``headers`` go in
    the request log with it.
    """
    path = path.rstrip("/") or "/"
    methods = ROUTES.get(path)
    if methods is None:
        return RouteAnswer(status=404, body={"detail": "Not Found"})
    route = methods.get(method)
    if route is None:
        return RouteAnswer(status=405, body={"detail": "Method Not Allowed"})
    try:
        body = _parse_body(raw)
    except RequestError as exc:
        served.record(method, path, None, headers)
        return RouteAnswer(status=exc.status, body=exc.body)
    served.record(method, path, body, headers)
    try:
        _check_content_type(path, content_type if method == "POST" else None)
        return route(served, body, RouteAnswer())
    except RequestError as exc:
        return RouteAnswer(status=exc.status, body=exc.body)
    except Exception as exc:  # a bug or an engine failure: answer 500 instead of dropping the connection
        emit("local.request.failed", level="exception", path=path, error=type(exc).__name__)
        return RouteAnswer(status=500, body=error_body(str(exc), type="InternalServerError", code=500))


__all__ = ["ROUTES", "RouteAnswer", "handle"]
