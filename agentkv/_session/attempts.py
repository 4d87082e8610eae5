"""One try at sending a request, the record of an observed one, and the request builders.

The real request and the warm-ahead request are built by the same function, so their messages,
tools, ``tool_choice``, chat-template kwargs and ``cache_salt`` are serialised the same way and the
warm's rendered prompt is a token-exact prefix of the escalated request's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from agentkv.backends import Backend, redact_secrets
from agentkv.fleet import routing_headers, with_routing
from agentkv.retry import CLIENT_RETRIES_OFF, TurnTries
from agentkv.routing import RouteDecision
from agentkv.tenancy import with_body_salt
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.incremental import JsonSnapshot, snapshot
from agentkv.providers import Marks, strategy_for
from agentkv.wire.openai import endpoint_url, outgoing_body, routing_headers_of

# Everything that shapes the rendered prompt: a warm carries exactly these from the caller's request.
# ``cache_salt`` shapes no prompt but the cache group the warm lands in (it goes only where the caller's is kept).
PROMPT_KEYS = ("messages", "tools", "tool_choice", "functions", "chat_template", "chat_template_kwargs",
               "add_generation_prompt", "continue_final_message", "documents", "reasoning_effort", "extra_body",
               "cache_salt")
_ADDRESS_KEYS = ("model", "api_base", "base_url", "api_key")


@dataclass
class Attempt:
    """One try at sending a request: the route, the backend, the caller's kwargs and what was counted."""

    decision: RouteDecision
    backend: Backend
    kwargs: Mapping[str, Any]
    payload: Payload
    count: TokenCount
    cache_salt: str | None = field(repr=False)  # a salt is a capability: never in a repr
    reactive_clamped: bool = False
    warm: str = ""
    handed_off: bool = False
    handoff_export: str | None = None  # the KV export this request names (a vLLM handoff), counted at its answer
    failed_over: bool = False
    timeout_s: float | None = None
    raw: bool = False  # ``kwargs`` is a raw OpenAI request body (the httpx transport), sent as it is
    sent_at: float | None = None  # the ledger's clock when planned (a Session with a ledger only)
    keeps_caller_salt: bool = False  # the caller's own cache_salt may go out (tenancy.keeps_caller_salt)
    turn: TurnTries = field(default_factory=TurnTries)  # shared by every try of one turn (``replace`` keeps it)
    routing_key: str | None = field(default=None, repr=False)  # the conversation's key, on every request it sends
    cache_end: int | None = None  # messages the conversation's last hosted cache write covered (wire.hosted)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # a raw request's own headers (its warm's)
    span: Any = field(default=None, repr=False, compare=False)  # the turn's OpenTelemetry span (None: not recorded)
    span_started: float | None = field(default=None, repr=False, compare=False)
    raw_body: Mapping[str, Any] | None = field(default=None, repr=False)  # a prepared request's body as the caller sent it

    # ----------------------------------------------------------------- a prepared (raw) request on the wire

    @property
    def url(self) -> str:
        """Where this try goes: the backend's ``/chat/completions``, or ``/completions`` for a text completion."""
        return endpoint_url(self)

    @property
    def body(self) -> dict[str, Any]:
        """This try's JSON body: the caller's (streaming switches included; its ``model`` on a fast try, slow's
        model id on a slow one), with the clamped budget, the tenant's salt where the backend takes one, the
        provider's marks and the KV import a handoff named."""
        return outgoing_body(self.raw_body or self.kwargs, self)

    @property
    def content(self) -> bytes:
        """:attr:`body` as the bytes to send."""
        return json.dumps(self.body).encode()

    @property
    def send_headers(self) -> dict[str, str]:
        """The headers this try carries besides the caller's own: the conversation's routing key under the backend's
        affinity header names (a header the caller set wins)."""
        return routing_headers_of(self)

    def __repr__(self) -> str:
        """The fields but the salt, with credentials in the caller's kwargs redacted (``api_key``, headers, URLs)."""
        shown = [f"{spec.name}={redact_secrets(getattr(self, spec.name))!r}" for spec in fields(self) if spec.repr]
        return f"Attempt({', '.join(shown)})"

    @property
    def text(self) -> bool:
        """True for a text completion (a ``prompt``, no ``messages``): it goes to ``/completions``."""
        return self.payload.messages is None

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """The litellm kwargs for this try (the Session's request timeout unless the caller set one)."""
        call = request_kwargs(self.backend, self.kwargs, self.cache_salt, max_tokens=self.decision.max_tokens,
                              keep_caller_salt=self.keeps_caller_salt, routing_key=self.routing_key,
                              cache_end=self.cache_end)
        if self.timeout_s is not None and call.get("timeout") is None:
            call["timeout"] = self.timeout_s
        return call


def request_kwargs(backend: Backend, kwargs: Mapping[str, Any], salt: str | None, *, max_tokens: int | None,
                   keep_caller_salt: bool = False, routing_key: str | None = None,
                   cache_end: int | None = None) -> dict[str, Any]:
    """The caller's kwargs addressed to ``backend``; the caller's own objects are never edited.

    Messages and tools go whole and in order, as copies (litellm may edit them in place); every other
    value is passed through as it is. ``max_tokens`` replaces the caller's budget only when routing
    clamped it, in every budget key the caller set (vLLM obeys ``max_completion_tokens`` first). The only
    ``cache_salt`` sent is ``salt`` (self-hosted backends only), unless ``keep_caller_salt`` lets the
    caller's own go (:func:`agentkv.tenancy.with_cache_salt`). ``routing_key`` goes in the backend's affinity headers
    (:func:`agentkv.fleet.with_routing`: a session header the caller set wins). A hosted provider's request carries
    its cache fields (its provider's strategy: :meth:`agentkv.providers.ProviderStrategy.marked`; ``cache_end``: the
    messages the conversation's last cache write covered) and never a ``cache_salt``, which no managed API takes.
    """
    call = {k: v for k, v in kwargs.items() if k not in _ADDRESS_KEYS}
    for key in ("messages", "tools"):
        if call.get(key) is not None:
            call[key] = _copied(call[key])
    call.update(backend.litellm_kwargs())
    if max_tokens is not None:
        keys = [k for k in ("max_tokens", "max_completion_tokens") if kwargs.get(k) is not None] or ["max_tokens"]
        call.update({key: max_tokens for key in keys})
    with_routing(call, backend, routing_key)
    marks = Marks(salt=salt, keep_caller_salt=keep_caller_salt, routing_key=routing_key, cache_end=cache_end)
    return strategy_for(backend).marked(backend, call, marks)


def _copied(value: Any) -> Any:
    try:
        return snapshot(value)
    except Exception:  # an uncopyable object inside a message: pass a copy of the list, not the caller's
        return list(value)


def warm_kwargs(slow: Backend, kwargs: Mapping[str, Any], salt: str | None, timeout_s: float, *,
                keep_caller_salt: bool = False, routing_key: str | None = None) -> dict[str, Any]:
    """A one-token request to ``slow`` carrying exactly what shapes the escalated request's prompt, and the caller's
    routing headers (those of its ``extra_headers`` that ``slow`` names: :func:`agentkv.fleet.routing_headers`) with
    the conversation's key, so that a router sends it where it sends the turn."""
    shaped = {k: kwargs[k] for k in PROMPT_KEYS if k in kwargs}
    headers = routing_headers(slow, None, kwargs.get("extra_headers") if isinstance(kwargs.get("extra_headers"), Mapping)
                              else None)
    if headers:
        shaped["extra_headers"] = headers
    messages = shaped.get("messages")
    call = request_kwargs(slow, shaped, salt, max_tokens=1, keep_caller_salt=keep_caller_salt, routing_key=routing_key,
                          cache_end=len(messages) if isinstance(messages, (list, tuple)) else None)
    call.update(timeout=timeout_s, **CLIENT_RETRIES_OFF)  # one warm is one request, whatever the client retries
    return call


# Keys of a raw body that never shape the prompt and must not ride on a one-token warm.
_NOT_FOR_WARMS = ("stream", "stream_options", "max_completion_tokens", "max_tokens", "n", "best_of", "model")


def raw_warm_target(slow: Backend, *, text: bool = False) -> str | None:
    """The URL a warm to ``slow`` is POSTed to raw (``/completions`` for a ``text`` completion), or None to send it
    through litellm: its provider's strategy says (:meth:`agentkv.providers.ProviderStrategy.warm_url`)."""
    return strategy_for(slow).warm_url(slow, text=text)


def warm_body(slow: Backend, kwargs: Mapping[str, Any], salt: str | None, *, raw: bool,
              keep_caller_salt: bool = False, routing_key: str | None = None) -> dict[str, Any]:
    """The JSON body of a one-token warm to ``slow``, built from what the real request sends.

    ``raw``: ``kwargs`` is an OpenAI body (everything but the budget and streaming is kept as it is);
    otherwise litellm kwargs, of which the prompt-shaping keys are kept and ``extra_body`` is merged
    into the body as litellm and the OpenAI SDK do.
    """
    if raw:
        body = {k: v for k, v in kwargs.items() if k not in _NOT_FOR_WARMS}
    else:
        body = {k: kwargs[k] for k in PROMPT_KEYS if k in kwargs and k != "extra_body"}
        body.update(dict(kwargs.get("extra_body") or {}))
    body.update(model=slow.served_model, max_tokens=1)
    if slow.affinity_user and routing_key is not None and body.get("user") is None:
        body["user"] = routing_key
    return with_body_salt(body, salt, keep_caller=keep_caller_salt)


def as_litellm_sends(model: str, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """``kwargs`` with the tool schemas as litellm sends them to ``model`` (what is counted and warmed).

    litellm removes every ``strict`` key and every ``additionalProperties: false`` from the tools it
    sends to ``hosted_vllm``; the caller's objects are never edited.
    """
    if not _strips_tools(model) or not kwargs.get("tools"):
        return kwargs
    return {**kwargs, "tools": [_stripped(snapshot(tool)) for tool in kwargs["tools"]]}


class LitellmSends:
    """:func:`as_litellm_sends` for one Session: the stripped tools are rebuilt only when the caller's tools
    differ from the previous request's (compared with a copy, so an in-place edit is seen), and the same
    stripped list is reused otherwise (it is never edited: the request builder copies what it sends)."""

    def __init__(self) -> None:
        # the caller's tools copied (1, 1.0 and True are == but not the same JSON), the model, the result
        self._last: tuple[JsonSnapshot, str, Mapping[str, Any]] | None = None

    def __call__(self, model: str, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        tools = kwargs.get("tools")
        if not _strips_tools(model) or not tools or not isinstance(tools, (list, tuple)):
            return as_litellm_sends(model, kwargs)
        last = self._last
        if last is None or last[1] != model or not last[0].matches(list(tools)):
            last = self._last = (JsonSnapshot(list(tools)), model, as_litellm_sends(model, {"tools": tools}))
        return {**kwargs, "tools": last[2]["tools"]}


def _strips_tools(model: str) -> bool:
    return model.startswith("hosted_vllm/")


def _stripped(schema: Any) -> Any:
    if isinstance(schema, dict):
        if schema.get("additionalProperties") is False:
            del schema["additionalProperties"]
        schema.pop("strict", None)
        for value in schema.values():
            _stripped(value)
    elif isinstance(schema, list):
        for item in schema:
            _stripped(item)
    return schema
