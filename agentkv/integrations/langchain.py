"""LangChain: a callback handler that accounts chat-model calls in a Session, and a router that reroutes.

    from agentkv.integrations.langchain import AgentKVCallbackHandler, ChatAgentKV

    handler = AgentKVCallbackHandler(session, block_overflow=True)
    model.invoke(messages, config={"callbacks": [handler]})   # counted, warmed, stopped if it cannot fit
    session.ledger, handler.counters

    router = ChatAgentKV(fast_model, slow_model, session).bind_tools(tools)
    router.invoke(messages)                                    # the Session's route picks the model

The handler sees each call before it is sent: it converts the messages and the bound tools
(``invocation_params["tools"]``) to the OpenAI form and calls :meth:`Session.observe`, so the
ledger holds exact counts and warm-ahead fires when the conversation crosses its threshold. When
the call ends it records the response's cached tokens; when it fails with a context overflow it
counts it. A callback cannot change which model LangChain calls, so ``block_overflow=True`` can
only stop a call that will not fit (raising :class:`~agentkv.errors.ContextOverflowError` that
names the slow backend); :class:`ChatAgentKV` (or the httpx transport of
:mod:`agentkv.integrations.openai`) is the pattern that actually reroutes. The handler cannot add the
tenant's ``cache_salt`` to the requests it observes: it warns once when a self-hosted call lacks it
(fix: ``ChatOpenAI(..., **session.request_extras("fast"))``).

Use :class:`AgentKVCallbackHandler` with ``invoke`` and :class:`AsyncAgentKVCallbackHandler` with
``ainvoke``: LangChain swallows errors raised by an async handler under a sync ``invoke``, so
blocking only works with the matching twin.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any
from uuid import UUID

from cachetools import LRUCache
from langchain_core.callbacks import (
    AsyncCallbackHandler, AsyncCallbackManagerForLLMRun, BaseCallbackHandler, CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.messages import AIMessage, BaseMessage, convert_to_openai_messages
from langchain_core.runnables import Runnable, RunnableBinding
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentkv.conversations import Conversations, session_of
from agentkv.errors import ConfigurationError, ContextOverflowError
from agentkv.events import emit
from agentkv.overflow import overflow_from_error
from agentkv.protocols import SessionLike
from agentkv._session import Attempt, Observation
from agentkv.wire.hosted import openai_keyed
from agentkv.wire.openai import OBSERVED_KEYS

_AGENTS = ("AgentKVMiddleware", "token_counter")  # LangChain 1.x agents: agentkv.integrations.langchain_agents


def __getattr__(name: str) -> Any:
    """:class:`AgentKVMiddleware` and :func:`token_counter` for ``create_agent``, imported on first use: they need the
    ``langchain`` package, which the rest of this module (``langchain-core`` only) does not."""
    if name in _AGENTS:
        from agentkv.integrations import langchain_agents

        return getattr(langchain_agents, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SALT_WARNED: LRUCache[str, bool] = LRUCache(maxsize=4096)  # Sessions already warned about a missing salt
_SALT_LOCK = threading.Lock()

COUNTERS = ("observed", "blocked", "usage_recorded", "overflow_errors", "other_errors", "unknown_runs")


# ----------------------------------------------------------------------------- pure helpers
def chat_request(messages: Sequence[BaseMessage], invocation_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The OpenAI-style request kwargs of one LangChain chat call: messages, plus bound tools and budgets.

    Messages are serialised as ``ChatOpenAI`` serialises them (content blocks stay a list), so the
    count and the warm match the request that is actually sent.
    """
    params = invocation_params or {}
    request: dict[str, Any] = {"messages": openai_messages(messages)}
    for key in OBSERVED_KEYS:
        value = params.get(key)
        if value is None or (key.startswith("max_") and (not isinstance(value, int) or value < 1)):
            continue
        request[key] = [convert_to_openai_tool(t) for t in value] if key == "tools" else value
    return request


def openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """The messages as ``ChatOpenAI`` puts them on the wire (its own converter when langchain-openai is here)."""
    try:
        from langchain_openai.chat_models.base import _convert_from_v1_to_chat_completions, _convert_message_to_dict
    except ImportError:  # without langchain-openai: the same shapes, content blocks kept as a list
        return [convert_to_openai_messages(m, text_format="block" if isinstance(m.content, list) else "string")
                for m in messages]
    return [_convert_message_to_dict(_convert_from_v1_to_chat_completions(m) if isinstance(m, AIMessage) else m)
            for m in messages]


def thread_of(metadata: Mapping[str, Any] | None) -> str | None:
    """LangGraph's ``thread_id`` (its run config's ``configurable``, which it copies into every callback's
    ``metadata``), or None: the conversation a :class:`~agentkv.Conversations` serves the call in."""
    value = (metadata or {}).get("thread_id")
    if isinstance(value, bool) or not isinstance(value, (str, int, UUID)):
        return None
    return str(value) or None


def _first_warning(session_id: str) -> bool:
    """True the first time a Session is warned about a missing salt (once per Session, any handler)."""
    with _SALT_LOCK:
        first = session_id not in _SALT_WARNED
        _SALT_WARNED[session_id] = True
        return first


def salt_missing(invocation_params: Mapping[str, Any] | None, session: SessionLike) -> bool:
    """True when a call to a self-hosted fast backend will go out without the Session's ``cache_salt``."""
    salt = session.request_extras("fast").get("extra_body", {}).get("cache_salt")
    if salt is None or not session.fast.api_base:
        return False
    extra = (invocation_params or {}).get("extra_body") or {}
    return not isinstance(extra, Mapping) or extra.get("cache_salt") != salt


def refusal(observation: Observation, session: SessionLike) -> ContextOverflowError | None:
    """The error that stops an observed call which cannot be sent as it is to the fast model, or None."""
    decision, count = observation.decision, observation.count
    fast = session.fast.label
    slow = session.slow.label if session.slow is not None else None
    windows = {fast: observation.window}
    if slow is not None:
        windows[slow] = observation.slow_window
    base = f"{count.total} input tokens (counted by {count.source}) do not fit {fast!r} (window {observation.window})"
    if decision is None:
        return ContextOverflowError(f"{base}, nor any other backend; nothing was sent",
                                    input_tokens=count.total, windows=windows)
    if decision.role == "slow":
        return ContextOverflowError(
            f"{base}; send it to {slow!r} (window {decision.window}) instead: a callback cannot reroute, "
            "AgentKVRouter can", input_tokens=count.total, windows=windows, max_tokens=decision.max_tokens,
            suggested_backend=slow)
    if decision.note:
        return ContextOverflowError(f"{base}; {decision.note}", input_tokens=count.total, windows=windows)
    if decision.reason == "clamped":
        return ContextOverflowError(
            f"{count.total} input tokens fit {fast!r} (window {observation.window}) but the requested output does "
            f"not: at most {decision.max_tokens} output tokens fit", input_tokens=count.total, windows=windows,
            max_tokens=decision.max_tokens, suggested_backend=fast)
    return None


def cached_tokens(generation_message: Any, llm_output: Mapping[str, Any] | None) -> int | None:
    """Cached prompt tokens from ``usage_metadata.input_token_details.cache_read``, else OpenAI's token usage."""
    usage = getattr(generation_message, "usage_metadata", None) or {}
    cached = (usage.get("input_token_details") or {}).get("cache_read")
    if isinstance(cached, int):
        return cached
    token_usage = (llm_output or {}).get("token_usage") or {}
    cached = (token_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) else None


# ----------------------------------------------------------------------------- the shared core
class _Accounting:
    """Run tracking, counters and the overflow guard both handlers share.

    Runs are keyed by their full UUID (LangChain's run ids are UUIDv7: runs started together share
    long prefixes).
    """

    def __init__(self, session: SessionLike | Conversations, block_overflow: bool) -> None:
        self.session = session
        self.block_overflow = block_overflow
        self.raise_error = block_overflow  # LangChain re-raises a handler's error only when this is True
        self._runs: dict[UUID, list[tuple[SessionLike, int]]] = {}
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._lock = threading.Lock()

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot: calls observed and blocked, usages recorded, overflow and other errors, unknown run ids."""
        with self._lock:
            return dict(self._counts)

    @property
    def runs(self) -> dict[UUID, list[int]]:
        """Runs in flight: run id -> the ledger turns observed for it (each in its conversation's Session)."""
        with self._lock:
            return {k: [turn for _, turn in v] for k, v in self._runs.items()}

    def _add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _requests(self, messages: list[list[BaseMessage]],
                  kwargs: Mapping[str, Any]) -> list[tuple[SessionLike, dict[str, Any]]]:
        """Each prompt's request, with the Session it is observed in: ``session``, or its conversation's (LangGraph's
        ``thread_id`` in the run's ``metadata``, else the prompt's opening; ``tenant_of`` gets that metadata)."""
        params, metadata = kwargs.get("invocation_params"), kwargs.get("metadata") or {}
        found = []
        for batch in messages:
            request = chat_request(batch, params)
            session = session_of(self.session, conversation=thread_of(metadata), body=request, request=metadata)
            if salt_missing(params, session) and _first_warning(session.session_id):
                emit("cache_salt_missing", level="warning", session=session.session_id,
                     fix="ChatOpenAI(..., **session.request_extras('fast'))")
            found.append((session, request))
        return found

    def _started(self, run_id: UUID, observed: list[tuple[SessionLike, Observation]]) -> None:
        with self._lock:
            self._runs[run_id] = [(session, o.turn) for session, o in observed]
            self._counts["observed"] += len(observed)
        if not self.block_overflow:
            return
        for session, observation in observed:
            error = refusal(observation, session)
            if error is not None:
                self._finish(run_id)
                self._add("blocked")
                emit("langchain_blocked", input_tokens=error.input_tokens, windows=error.windows,
                     suggested=error.suggested_backend, session=session.session_id)
                raise error

    def _finish(self, run_id: UUID) -> list[tuple[SessionLike, int]] | None:
        with self._lock:
            turns = self._runs.pop(run_id, None)
            if turns is None:
                self._counts["unknown_runs"] += 1
            return turns

    def _ended(self, response: Any, run_id: UUID) -> None:
        turns = self._finish(run_id)
        for (session, turn), generations in zip(turns or (), response.generations):
            if not generations:
                continue
            cached = cached_tokens(getattr(generations[0], "message", None), response.llm_output)
            if cached is not None:
                session.record_usage(turn, cached_tokens=cached)
                self._add("usage_recorded")

    def _failed(self, error: BaseException, run_id: UUID) -> None:
        self._finish(run_id)
        if isinstance(error, ContextOverflowError):
            return  # our own block, already counted
        self._add("overflow_errors" if overflow_from_error(error) is not None else "other_errors")


class AgentKVCallbackHandler(_Accounting, BaseCallbackHandler):
    """Accounts LangChain chat-model calls in ``session``; ``block_overflow`` stops calls that will not fit.

    ``session`` may be a :class:`~agentkv.Conversations`: each call is then accounted in its conversation's Session,
    the one LangGraph's ``thread_id`` names (it is in the callback's ``metadata``; outside LangGraph, pass
    ``config={"metadata": {"thread_id": ...}}``), else the one its opening's fingerprint names."""

    def __init__(self, session: SessionLike | Conversations, *, block_overflow: bool = False) -> None:
        super().__init__(session, block_overflow)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, [(s, s.observe(**r)) for s, r in self._requests(messages, kwargs)])

    def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._ended(response, run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        self._failed(error, run_id)


class AsyncAgentKVCallbackHandler(_Accounting, AsyncCallbackHandler):
    """The async twin of :class:`AgentKVCallbackHandler` (counts over async HTTP; warms run as tasks)."""

    def __init__(self, session: SessionLike | Conversations, *, block_overflow: bool = False) -> None:
        super().__init__(session, block_overflow)

    async def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *,
                                  run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, [(s, await s.aobserve(**r)) for s, r in self._requests(messages, kwargs)])

    async def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                         **kwargs: Any) -> None:
        self._ended(response, run_id)

    async def on_llm_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                           **kwargs: Any) -> None:
        self._failed(error, run_id)


# ----------------------------------------------------------------------------- the router
class ChatAgentKV(BaseChatModel):
    """A chat model that sends each call to ``fast_model`` or ``slow_model`` by the Session's routing decision.

    Each call is prepared like :meth:`Session.completion` prepares one (counted as ChatOpenAI sends it,
    routed, clamped, warmed) and carries the tenant's ``cache_salt`` (on models with ``extra_body``, as
    ``ChatOpenAI``); a context overflow from fast is re-sent to slow; the answer is recorded (requests,
    escalations, cached tokens). ``bind_tools``, ``with_structured_output``, token streaming and
    LangGraph's ``create_react_agent(..., response_format=...)`` work as on any chat model.

        model = ChatAgentKV(ChatOpenAI(base_url=fast_url), ChatOpenAI(base_url=slow_url), session)
        agent_model = model.bind_tools([search, fetch])

    ``session`` may be a :class:`~agentkv.Conversations`, for one model serving many conversations: each call goes
    through its conversation's Session, the one LangGraph's ``thread_id`` names (LangChain hands it to the call in the
    run's metadata; outside LangGraph, pass ``config={"metadata": {"thread_id": ...}}``), else the one its opening
    (system prompt, first user message, tools) names. ``tenant_of`` gets the run's metadata.
    """

    fast_model: Any
    slow_model: Any
    session: Any
    last_role: str | None = None

    def __init__(self, fast_model: Any, slow_model: Any, session: SessionLike | Conversations, **kwargs: Any) -> None:
        pools = [b.label for b in (getattr(session, "fast", None), getattr(session, "slow", None))
                 if getattr(b, "is_pool", False)]
        if pools:  # each LangChain chat model addresses one URL: it cannot follow a conversation's replica
            raise ConfigurationError(f"ChatAgentKV sends through LangChain models, each at one URL; {pools} are pools "
                                     "of replicas: put a router in front of them (docs/fleet.md) and give the models "
                                     "and the Session its URL")
        super().__init__(fast_model=fast_model, slow_model=slow_model, session=session, **kwargs)

    @property
    def _llm_type(self) -> str:
        return "agentkv"

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools counted when a call binds none: those already bound to ``fast_model``."""
        return [convert_to_openai_tool(t) for t in _unwrapped(self.fast_model)[1].get("tools") or ()]

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,  # type: ignore[override]
                   **kwargs: Any) -> Runnable[Any, BaseMessage]:
        """This model with ``tools`` bound (as OpenAI schemas) to every call, on whichever model answers."""
        if tool_choice is not None:
            kwargs["tool_choice"] = _tool_choice(tool_choice)
        return self.bind(tools=[convert_to_openai_tool(t, strict=kwargs.pop("strict", None)) for t in tools],
                         **kwargs)

    # ------------------------------------------------------------- shared steps
    def _request(self, messages: list[BaseMessage], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        params = {**_unwrapped(self.fast_model)[1], **kwargs}
        budget = getattr(_unwrapped(self.fast_model)[0], "max_tokens", None)
        if params.get("max_tokens") is None and isinstance(budget, int):
            params["max_tokens"] = budget
        return chat_request(messages, params)

    def _session(self, request: Mapping[str, Any], run_manager: Any) -> Any:
        """The Session this call goes through: ``session``, or its conversation's (:func:`thread_of` the run's
        metadata, else the request's opening)."""
        metadata = getattr(run_manager, "metadata", None) or {}
        return session_of(self.session, conversation=thread_of(metadata), body=request, request=metadata)

    def _call(self, attempt: Attempt, kwargs: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The model this try goes to and its kwargs: bound ones, the clamped budget, the tenant's salt, a handoff's
        import and the conversation's routing key (the last three for OpenAI-compatible models only)."""
        self.last_role = attempt.decision.role
        model, bound = _unwrapped(self.slow_model if attempt.decision.role == "slow" else self.fast_model)
        call = {**bound, **kwargs}
        if attempt.decision.reason in ("clamped", "reactive_clamp") and attempt.decision.max_tokens is not None:
            call["max_tokens"] = attempt.decision.max_tokens
            if getattr(model, "max_tokens", None) is not None:
                call["max_completion_tokens"] = attempt.decision.max_tokens
        if not hasattr(model, "extra_body"):  # not an OpenAI-compatible chat model: nothing of vLLM's goes along
            return model, call
        extra = {**(model.extra_body or {}), **(call.get("extra_body") or {})}
        named = (attempt.kwargs.get("extra_body") or {}).get("kv_transfer_params")
        if attempt.handoff_export is not None and named is not None:  # a vLLM handoff's import, named by this try
            extra["kv_transfer_params"] = named
        salt = attempt.cache_salt  # the tenant's, or a handoff's import salt
        if salt is not None and attempt.backend.self_hosted:
            extra["cache_salt"] = salt
        elif not attempt.backend.self_hosted:  # no hosted API takes a salt: it would leave for a third party, and 400
            extra.pop("cache_salt", None)
        if attempt.backend.provider_kind == "openai":  # OpenAI's prompt cache, routed by the conversation
            extra.update({k: v for k, v in openai_keyed({}, routing_key=attempt.routing_key,
                                                        retention=attempt.backend.cache_retention).items()
                          if k not in extra})
        if extra:
            call["extra_body"] = extra
        headers = attempt.send_headers  # the conversation's routing key (a header the caller set wins)
        if headers:
            call["extra_headers"] = {**headers, **(call.get("extra_headers") or {})}
        return model, call

    # ------------------------------------------------------------- the four drivers, on the Session's one loop
    # Each try goes to the chosen LangChain model, which retries on its own (``max_retries``): the Session's turn sends
    # each try once (``retries=False``) and decides the rest (recover an overflow, fail over an outage).
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        def send(attempt: Attempt) -> ChatResult:
            model, call = self._call(attempt, kwargs)
            return model._generate(messages, stop=stop, run_manager=run_manager, **call)  # type: ignore[no-any-return]

        request = self._request(messages, kwargs)
        session = self._session(request, run_manager)
        ended = session.turn(session.prepare(request), send, retries=False)
        result = ended.result()
        session.answered(ended.attempt, _usage(result.generations[0].message, result.llm_output))
        return result

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        async def send(attempt: Attempt) -> ChatResult:
            model, call = self._call(attempt, kwargs)
            return await model._agenerate(messages, stop=stop, run_manager=run_manager, **call)  # type: ignore[no-any-return]

        request = self._request(messages, kwargs)
        session = self._session(request, run_manager)
        ended = await session.aturn(await session.aprepare(request), send, retries=False)
        result = ended.result()
        session.answered(ended.attempt, _usage(result.generations[0].message, result.llm_output))
        return result

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        def send(attempt: Attempt) -> tuple[Any, Iterator[ChatGenerationChunk]]:
            model, call = self._call(attempt, kwargs)
            chunks = model._stream(messages, stop=stop, run_manager=run_manager, **call)
            return next(chunks, None), chunks  # an overflow is raised before the first chunk

        request = self._request(messages, kwargs)
        session = self._session(request, run_manager)
        ended = session.turn(session.prepare(request), send, streamed=True, retries=False)
        first, chunks = ended.result()
        usage: dict[str, Any] = {}
        for chunk in itertools.chain([first] if first is not None else [], chunks):
            usage = _usage(chunk.message, None) or usage
            yield chunk
        session.answered(ended.attempt, usage)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async def send(attempt: Attempt) -> tuple[Any, AsyncIterator[ChatGenerationChunk]]:
            model, call = self._call(attempt, kwargs)
            chunks = model._astream(messages, stop=stop, run_manager=run_manager, **call)
            return await anext(chunks, None), chunks

        request = self._request(messages, kwargs)
        session = self._session(request, run_manager)
        ended = await session.aturn(await session.aprepare(request), send, streamed=True, retries=False)
        first, chunks = ended.result()
        usage: dict[str, Any] = {}
        if first is not None:
            usage = _usage(first.message, None) or usage
            yield first
        async for chunk in chunks:
            usage = _usage(chunk.message, None) or usage
            yield chunk
        session.answered(ended.attempt, usage)


AgentKVRouter = ChatAgentKV  # the name before it became a real chat model


def _unwrapped(model: Any) -> tuple[Any, dict[str, Any]]:
    """A chat model and the kwargs bound to it (``model.bind_tools(...)`` gives a RunnableBinding)."""
    if isinstance(model, RunnableBinding):
        inner, bound = _unwrapped(model.bound)
        return inner, {**bound, **model.kwargs}
    return model, {}


def _tool_choice(choice: Any) -> Any:
    """LangChain's tool_choice spellings in OpenAI's: "any" is "required", a tool name picks that function."""
    if choice in ("any", True):
        return "required"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _usage(message: Any, llm_output: Mapping[str, Any] | None) -> dict[str, Any]:
    """A response's cached tokens in OpenAI's ``usage`` shape, for :meth:`Session.answered` ({} when unknown)."""
    cached = cached_tokens(message, llm_output)
    return {} if cached is None else {"usage": {"prompt_tokens_details": {"cached_tokens": cached}}}
