"""LangChain 1.x agents: a middleware that routes every model call of ``create_agent``, and a token counter.

    from langchain.agents import create_agent
    from langchain.agents.middleware import SummarizationMiddleware
    from agentkv.integrations.langchain import AgentKVMiddleware, token_counter

    agent = create_agent(model=fast_model, tools=tools, system_prompt=prompt,
                         middleware=[AgentKVMiddleware(conversations, slow=slow_model)])
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "chat-42"}})

    SummarizationMiddleware(model=..., trigger=("tokens", 6000),
                            token_counter=token_counter(conversations, tools=tools, system_prompt=prompt))

:class:`AgentKVMiddleware` sees each model call (``wrap_model_call``/``awrap_model_call``; a run streamed with
``stream_mode="messages"`` goes through them too). It finds the conversation's Session (a :class:`~agentkv.Session`
as it is; a ``Conversations`` by LangGraph's ``thread_id``, else by the opening of the request), counts the request
as ``ChatOpenAI`` sends it (the system prompt, the messages, the bound tools as OpenAI schemas) through
:meth:`Session.prepare`, which routes, clamps and fires the warm-ahead, and runs the turn in the Session's one loop
(:meth:`Session.turn`): each try calls the agent's own handler with the request on the model the route chose
(``request.override(model=slow)``), the clamped budget and, for an OpenAI-compatible model (one with
``extra_body``), the tenant's ``cache_salt`` when the backend is self-hosted (never to a hosted one); a context
overflow from fast is re-sent to slow. The answer's usage and cached tokens go to :meth:`Session.answered`.

:func:`token_counter` gives ``SummarizationMiddleware`` a counter that counts what the backend receives (system
prompt and tool schemas included) without any HTTP: exact from the fast backend's declared tokenizer and chat
template, else the bounded local estimate the Session's own counter makes.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cachetools import LRUCache
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, BaseMessage, convert_to_messages, convert_to_openai_messages
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentkv._session import Attempt, Session
from agentkv.conversations import Conversations, session_of
from agentkv.errors import ConfigurationError
from agentkv.tokens import TokenCounter, payload_from_request
from agentkv.wire.hosted import openai_keyed

if TYPE_CHECKING:
    from langchain.agents.middleware import ModelRequest, ModelResponse

__all__ = ["AgentKVMiddleware", "MessagesCounter", "bound_tools", "call_settings", "model_request_body", "thread_id",
           "token_counter"]

_BUDGETS = ("max_tokens", "max_completion_tokens")
_CLAMPS = ("clamped", "reactive_clamp")


# ----------------------------------------------------------------------------- the wire form, cached per message
class WireMessages:
    """LangChain messages as ``ChatOpenAI`` puts them on the wire, each converted once.

    A message is kept (with its converted form) while it is among the latest ``maxsize`` seen, by identity: a
    message whose ``content`` or ``tool_calls`` was reassigned is converted again (an edit inside a content list is
    not seen; LangChain treats messages as values)."""

    def __init__(self, maxsize: int = 4096) -> None:
        self._seen: LRUCache[int, tuple[Any, Any, Any, dict[str, Any]]] = LRUCache(maxsize)
        self._lock = threading.Lock()

    def __call__(self, messages: Sequence[Any]) -> list[dict[str, Any]]:
        return [self._one(m) for m in _typed(messages)]

    def _one(self, message: BaseMessage) -> dict[str, Any]:
        content, calls = message.content, getattr(message, "tool_calls", None)
        with self._lock:
            kept = self._seen.get(id(message))
        if kept is not None and kept[0] is message and kept[1] is content and kept[2] is calls:
            return kept[3]
        wire = _wire_message(message)
        with self._lock:
            self._seen[id(message)] = (message, content, calls, wire)
        return wire


def wire_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """``messages`` as ``ChatOpenAI`` puts them on the wire (content blocks stay a list), converted afresh."""
    return [_wire_message(m) for m in _typed(messages)]


def _typed(messages: Sequence[Any]) -> Sequence[BaseMessage]:
    return messages if all(isinstance(m, BaseMessage) for m in messages) else convert_to_messages(messages)


def _wire_message(message: BaseMessage) -> dict[str, Any]:
    """One message as ``ChatOpenAI`` serialises it (its own converter when langchain-openai is here)."""
    try:
        from langchain_openai.chat_models.base import (  # type: ignore[attr-defined]
            _convert_from_v1_to_chat_completions, _convert_message_to_dict,
        )
    except ImportError:  # without langchain-openai: the same shapes, content blocks kept as a list
        return dict(convert_to_openai_messages(message, text_format="block" if isinstance(message.content, list)
                                               else "string"))
    if isinstance(message, AIMessage):
        message = _convert_from_v1_to_chat_completions(message)
    return dict(_convert_message_to_dict(message))


# ----------------------------------------------------------------------------- pure helpers
def model_request_body(request: ModelRequest, wire: Callable[[Sequence[Any]], list[dict[str, Any]]] | None = None,
                       ) -> dict[str, Any]:
    """The OpenAI body ``ChatOpenAI`` sends for a ``create_agent`` model call: its ``extra_body`` (flattened, as the
    SDK sends it, without any ``cache_salt``: the Session sets the tenant's), the system message and the messages,
    the tools as OpenAI schemas with the tool choice, and the output budget (the call's, else the model's)."""
    settings = request.model_settings or {}
    body = {k: v for k, v in _extra_body(request.model, settings).items() if k != "cache_salt"}
    messages = [request.system_message, *request.messages] if request.system_message is not None else request.messages
    body["messages"] = (wire or wire_messages)(messages)
    tools, choice, strict = bound_tools(request)
    if tools:
        body["tools"] = [convert_to_openai_tool(t, strict=strict) for t in tools]
        choice = _tool_choice(choice)
        if choice is not None:
            body["tool_choice"] = choice
    budget = next((settings[k] for k in _BUDGETS if settings.get(k) is not None), None)
    budget = budget if budget is not None else getattr(request.model, "max_tokens", None)
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        body["max_tokens"] = budget
    return body


def bound_tools(request: ModelRequest) -> tuple[list[Any], Any, bool | None]:
    """The tools, tool choice and ``strict`` that ``create_agent`` binds for ``request``: its own, plus a tool
    strategy's structured-output tools (a tool call then required); a provider strategy binds them strict (as
    ``ChatOpenAI`` does with a ``response_format``). An ``AutoStrategy`` is resolved as ``create_agent`` resolves it."""
    tools, choice, strict = list(request.tools), request.tool_choice, (request.model_settings or {}).get("strict")
    if request.response_format is None:
        return tools, choice, strict
    from langchain.agents.structured_output import AutoStrategy, OutputToolBinding, ProviderStrategy, ToolStrategy

    fmt = request.response_format
    if not isinstance(fmt, (ToolStrategy, ProviderStrategy)):  # an AutoStrategy, or a raw schema a middleware set
        schema = fmt.schema if isinstance(fmt, AutoStrategy) else fmt
        fmt = ProviderStrategy(schema) if _provider_strategy(request) else ToolStrategy(schema)
    if isinstance(fmt, ToolStrategy):
        return [*tools, *(OutputToolBinding.from_schema_spec(spec).tool for spec in fmt.schema_specs)], "any", strict
    return tools, choice, strict is not False


def _provider_strategy(request: ModelRequest) -> bool:
    """``create_agent``'s own test of whether the model takes a provider strategy (False where it cannot be asked)."""
    try:
        from langchain.agents.factory import _supports_provider_strategy
    except ImportError:
        return False
    return bool(_supports_provider_strategy(request.model, tools=request.tools))


def call_settings(attempt: Attempt, model: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The model settings one try runs with on ``model``: the call's own, the clamped budget and, for an
    OpenAI-compatible model (one with ``extra_body``), the tenant's ``cache_salt`` on a self-hosted backend (removed
    for a hosted one, which no hosted API takes), a vLLM handoff's import, OpenAI's prompt-cache key and the
    conversation's routing headers."""
    call = dict(settings)
    decision = attempt.decision
    if decision.reason in _CLAMPS and decision.max_tokens is not None:
        call["max_tokens"] = decision.max_tokens
        if getattr(model, "max_tokens", None) is not None:  # ChatOpenAI sends its own as max_completion_tokens
            call["max_completion_tokens"] = decision.max_tokens
    if not hasattr(model, "extra_body"):  # not an OpenAI-compatible chat model: nothing of vLLM's goes along
        return call
    extra = _extra_body(model, call)
    named = (attempt.kwargs.get("extra_body") or {}).get("kv_transfer_params") or attempt.kwargs.get(
        "kv_transfer_params")
    if attempt.handoff_export is not None and named is not None:
        extra["kv_transfer_params"] = named
    if attempt.cache_salt is not None and attempt.backend.self_hosted:
        extra["cache_salt"] = attempt.cache_salt
    else:
        extra.pop("cache_salt", None)
    if attempt.backend.provider_kind == "openai":
        keyed = openai_keyed({}, routing_key=attempt.routing_key, retention=attempt.backend.cache_retention)
        extra.update({k: v for k, v in keyed.items() if k not in extra})
    call.pop("extra_body", None)
    if extra:
        call["extra_body"] = extra
    headers = attempt.send_headers
    if headers:
        call["extra_headers"] = {**headers, **(call.get("extra_headers") or {})}
    return call


def response_usage(response: Any) -> dict[str, Any]:
    """A ``ModelResponse``'s usage in OpenAI's shape for :meth:`Session.answered` ({} when the answer has none)."""
    message = next((m for m in getattr(response, "result", ()) if isinstance(m, AIMessage)), None)
    usage = getattr(message, "usage_metadata", None) or {}
    out: dict[str, Any] = {}
    for theirs, ours in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
        if isinstance(usage.get(theirs), int):
            out[ours] = usage[theirs]
    cached = (usage.get("input_token_details") or {}).get("cache_read")
    if isinstance(cached, int):
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"usage": out} if out else {}


def thread_id(request: Any = None) -> str | None:
    """LangGraph's ``thread_id`` of the run a call belongs to: the run's config (``configurable.thread_id``), else
    the runtime's execution info; None outside a run, or in one without a thread."""
    value = _configurable().get("thread_id")
    if value is None:
        value = getattr(getattr(getattr(request, "runtime", None), "execution_info", None), "thread_id", None)
    return str(value) if value is not None and str(value) else None


def streams(request: Any) -> bool:
    """The call streams its tokens: the model is set to, or the run streams messages (a streaming handler)."""
    if getattr(request.model, "streaming", False) is True:
        return True
    callbacks = _config().get("callbacks")
    handlers = getattr(callbacks, "handlers", callbacks)
    return isinstance(handlers, list) and any(hasattr(h, "tap_output_iter") for h in handlers)


def _config() -> Mapping[str, Any]:
    try:
        from langgraph.config import get_config
    except ImportError:
        return {}
    try:
        config: Mapping[str, Any] = get_config()
    except RuntimeError:  # outside a runnable context
        return {}
    return config


def _configurable() -> Mapping[str, Any]:
    configurable = _config().get("configurable")
    return configurable if isinstance(configurable, Mapping) else {}


def _extra_body(model: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    own, call = getattr(model, "extra_body", None), settings.get("extra_body")
    return {**(own if isinstance(own, Mapping) else {}), **(call if isinstance(call, Mapping) else {})}


def _tool_choice(choice: Any) -> Any:
    """LangChain's tool_choice spellings in OpenAI's: "any" is "required", a tool name picks that function."""
    if choice in ("any", True):
        return "required"
    if choice is False:
        return None
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _one_url_each(session: Session) -> Session:
    """``session``, unless a backend is a pool: a LangChain model addresses one URL, not a conversation's replica."""
    pools = [b.label for b in (session.fast, session.slow) if b is not None and b.is_pool]
    if pools:
        raise ConfigurationError(f"AgentKVMiddleware sends through LangChain models, each at one URL; {pools} are "
                                 "pools of replicas: put a router in front of them (docs/fleet.md) and give the models "
                                 "and the Session its URL")
    return session


# ----------------------------------------------------------------------------- the middleware
class AgentKVMiddleware(AgentMiddleware):  # type: ignore[misc]  # LangChain is opaque to the type check
    """Routes every model call of a ``create_agent`` agent through the conversation's Session.

    ``target``: a :class:`~agentkv.Session` (one conversation) or a ``Conversations`` (one Session per LangGraph
    ``thread_id``, else per conversation opening; its ``tenant_of`` is handed the LangChain ``ModelRequest``).
    ``slow``: the chat model that answers what fast cannot hold (the agent's own model is fast). Both should
    address the Session's backends (their URLs and models)."""

    def __init__(self, target: Session | Conversations, *, slow: Any, cached_messages: int = 4096) -> None:
        super().__init__()
        self.target, self.slow = target, slow
        self._wire = WireMessages(cached_messages)

    def session_for(self, request: ModelRequest, body: Mapping[str, Any] | None = None) -> Session:
        """The Session that serves ``request`` (built by the ``Conversations`` on its conversation's first call)."""
        body = body if body is not None else model_request_body(request, self._wire)
        return _one_url_each(session_of(self.target, conversation=thread_id(request), body=body, request=request))

    def _routed(self, request: ModelRequest, attempt: Attempt) -> ModelRequest:
        model = self.slow if attempt.decision.role == "slow" else request.model
        return request.override(model=model, model_settings=call_settings(attempt, model, request.model_settings))

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        """Count, route, clamp and warm the call; run it on the chosen model; re-send a fast overflow to slow."""
        body = model_request_body(request, self._wire)
        session = self.session_for(request, body)
        ended = session.turn(session.prepare(body), lambda a: handler(self._routed(request, a)),
                             streamed=streams(request), retries=False)  # the models retry on their own
        response = ended.result()
        session.answered(ended.attempt, response_usage(response))
        return response

    async def awrap_model_call(self, request: ModelRequest,
                               handler: Callable[[ModelRequest], Awaitable[ModelResponse]]) -> Any:
        """The async twin of :meth:`wrap_model_call` (counted over async HTTP; the warm runs as a task)."""
        body = model_request_body(request, self._wire)
        session = self.session_for(request, body)

        async def send(attempt: Attempt) -> ModelResponse:
            return await handler(self._routed(request, attempt))

        ended = await session.aturn(await session.aprepare(body), send, streamed=streams(request), retries=False)
        response = ended.result()
        session.answered(ended.attempt, response_usage(response))
        return response


# ----------------------------------------------------------------------------- the token counter
class MessagesCounter:
    """``counter(messages) -> int``: the tokens the fast backend receives for ``messages`` after the system prompt,
    with the tool schemas, counted locally (no HTTP, ever): exact from a declared tokenizer and chat template, else
    the estimate the Session's counter makes, widened by what exact counts have taught it. Thread-safe; each
    message is converted once, and the counter's sources memoise per message and per appended turn."""

    def __init__(self, target: Session | Conversations, *, tools: Sequence[Any] | None = None,
                 system_prompt: str | None = None, cached_messages: int = 4096) -> None:
        self.target = target
        self.tools = [convert_to_openai_tool(t) for t in tools or ()]
        self._opening = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._wire = WireMessages(cached_messages)
        self._counter: TokenCounter | None = None
        self._lock = threading.Lock()

    def __call__(self, messages: Sequence[Any]) -> int:
        request = {"messages": [*self._opening, *self._wire(messages)], "tools": self.tools}
        return self.counter.estimate(payload_from_request(request)).total

    @property
    def counter(self) -> TokenCounter:
        """The local count ladder for the fast backend (built on first use; it shares the Session's bound)."""
        with self._lock:
            if self._counter is None:
                self._counter = TokenCounter.for_backend(self.target.fast, use_server=False)
            return self._counter


def token_counter(target: Session | Conversations, *, tools: Sequence[Any] | None = None,
                  system_prompt: str | None = None) -> MessagesCounter:
    """A ``token_counter`` for LangChain's ``SummarizationMiddleware``: counts as the fast backend renders the agent's
    request (``system_prompt`` and ``tools`` included), synchronously and without HTTP. ``target``: a
    :class:`~agentkv.Session` or a ``Conversations``."""
    return MessagesCounter(target, tools=tools, system_prompt=system_prompt)
