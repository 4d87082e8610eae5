"""LangChain: a callback handler that accounts chat-model calls in a Session, and a router that reroutes.

    from agentkv.integrations.langchain import AgentKVCallbackHandler, AgentKVRouter

    handler = AgentKVCallbackHandler(session, block_overflow=True)
    model.invoke(messages, config={"callbacks": [handler]})   # counted, warmed, stopped if it cannot fit
    session.ledger, handler.counters

    router = AgentKVRouter(fast_model, slow_model, session).bind_tools(tools)
    router.invoke(messages)                                    # the Session's route picks the model

The handler sees each call before it is sent: it converts the messages and the bound tools
(``invocation_params["tools"]``) to the OpenAI form and calls :meth:`Session.observe`, so the
ledger holds exact counts and warm-ahead fires when the conversation crosses its threshold. When
the call ends it records the response's cached tokens; when it fails with a context overflow it
counts it. A callback cannot change which model LangChain calls, so ``block_overflow=True`` can
only stop a call that will not fit (raising :class:`~agentkv.errors.ContextOverflowError` that
names the slow backend); :class:`AgentKVRouter` is the pattern that actually reroutes.

Use :class:`AgentKVCallbackHandler` with ``invoke`` and :class:`AsyncAgentKVCallbackHandler` with
``ainvoke``: LangChain swallows errors raised by an async handler under a sync ``invoke``, so
blocking only works with the matching twin.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.messages import BaseMessage, HumanMessage, convert_to_messages, convert_to_openai_messages
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentkv.errors import ContextOverflowError
from agentkv.events import emit
from agentkv.overflow import overflow_from_error
from agentkv.protocols import SessionLike
from agentkv._session.attempts import OBSERVED_KEYS, Observation

COUNTERS = ("observed", "blocked", "usage_recorded", "overflow_errors", "other_errors", "unknown_runs")


# ----------------------------------------------------------------------------- pure helpers
def chat_request(messages: Sequence[BaseMessage], invocation_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The OpenAI-style request kwargs of one LangChain chat call: messages, plus bound tools and budgets."""
    params = invocation_params or {}
    request: dict[str, Any] = {"messages": convert_to_openai_messages(list(messages))}
    for key in OBSERVED_KEYS:
        value = params.get(key)
        if value is None or (key.startswith("max_") and (not isinstance(value, int) or value < 1)):
            continue
        request[key] = [convert_to_openai_tool(t) for t in value] if key == "tools" else value
    return request


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

    def __init__(self, session: SessionLike, block_overflow: bool) -> None:
        self.session = session
        self.block_overflow = block_overflow
        self.raise_error = block_overflow  # LangChain re-raises a handler's error only when this is True
        self._runs: dict[UUID, list[int]] = {}
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._lock = threading.Lock()

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot: calls observed and blocked, usages recorded, overflow and other errors, unknown run ids."""
        with self._lock:
            return dict(self._counts)

    @property
    def runs(self) -> dict[UUID, list[int]]:
        """Runs in flight: run id -> the ledger turns observed for it."""
        with self._lock:
            return {k: list(v) for k, v in self._runs.items()}

    def _add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _requests(self, messages: list[list[BaseMessage]], kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [chat_request(batch, kwargs.get("invocation_params")) for batch in messages]

    def _started(self, run_id: UUID, observations: list[Observation]) -> None:
        with self._lock:
            self._runs[run_id] = [o.turn for o in observations]
            self._counts["observed"] += len(observations)
        if not self.block_overflow:
            return
        for observation in observations:
            error = refusal(observation, self.session)
            if error is not None:
                self._finish(run_id)
                self._add("blocked")
                emit("langchain_blocked", input_tokens=error.input_tokens, windows=error.windows,
                     suggested=error.suggested_backend, session=self.session.session_id)
                raise error

    def _finish(self, run_id: UUID) -> list[int] | None:
        with self._lock:
            turns = self._runs.pop(run_id, None)
            if turns is None:
                self._counts["unknown_runs"] += 1
            return turns

    def _ended(self, response: Any, run_id: UUID) -> None:
        turns = self._finish(run_id)
        for turn, generations in zip(turns or (), response.generations):
            if not generations:
                continue
            cached = cached_tokens(getattr(generations[0], "message", None), response.llm_output)
            if cached is not None:
                self.session.record_usage(turn, cached_tokens=cached)
                self._add("usage_recorded")

    def _failed(self, error: BaseException, run_id: UUID) -> None:
        self._finish(run_id)
        if isinstance(error, ContextOverflowError):
            return  # our own block, already counted
        self._add("overflow_errors" if overflow_from_error(error) is not None else "other_errors")


class AgentKVCallbackHandler(_Accounting, BaseCallbackHandler):
    """Accounts LangChain chat-model calls in ``session``; ``block_overflow`` stops calls that will not fit."""

    def __init__(self, session: SessionLike, *, block_overflow: bool = False) -> None:
        super().__init__(session, block_overflow)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, [self.session.observe(**r) for r in self._requests(messages, kwargs)])

    def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._ended(response, run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        self._failed(error, run_id)


class AsyncAgentKVCallbackHandler(_Accounting, AsyncCallbackHandler):
    """The async twin of :class:`AgentKVCallbackHandler` (counts over async HTTP; warms run as tasks)."""

    def __init__(self, session: SessionLike, *, block_overflow: bool = False) -> None:
        super().__init__(session, block_overflow)

    async def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *,
                                  run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, [await self.session.aobserve(**r) for r in self._requests(messages, kwargs)])

    async def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                         **kwargs: Any) -> None:
        self._ended(response, run_id)

    async def on_llm_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                           **kwargs: Any) -> None:
        self._failed(error, run_id)


# ----------------------------------------------------------------------------- the router
class AgentKVRouter(Runnable[Any, BaseMessage]):
    """A chat model that sends each call to ``fast_model`` or ``slow_model`` by the Session's routing decision.

    The call is observed (counted, ledgered, warmed) first; a request routed to slow goes to
    ``slow_model``, anything else to ``fast_model``; the answer's cached tokens are recorded. The tools
    counted come from ``tools=``, :meth:`bind_tools` (which binds them to both models), or the tools
    already bound to ``fast_model``. A request that fits only with a smaller output budget goes to
    ``fast_model`` unchanged: a router cannot clamp another library's ``max_tokens``.

        router = AgentKVRouter(ChatOpenAI(base_url=fast_url), ChatOpenAI(base_url=slow_url), session)
        agent_model = router.bind_tools([search, fetch])
    """

    def __init__(self, fast_model: Runnable[Any, Any], slow_model: Runnable[Any, Any], session: SessionLike, *,
                 tools: Sequence[Any] | None = None) -> None:
        self.fast_model, self.slow_model, self.session = fast_model, slow_model, session
        bound = getattr(fast_model, "kwargs", None) or {}  # a RunnableBinding from model.bind_tools(...)
        self.tools = [convert_to_openai_tool(t) for t in (tools if tools is not None else bound.get("tools") or ())]
        self.last_role: str | None = None

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> AgentKVRouter:
        """Both models with ``tools`` bound, and a router that counts them."""
        return AgentKVRouter(self.fast_model.bind_tools(tools, **kwargs),  # type: ignore[attr-defined]
                             self.slow_model.bind_tools(tools, **kwargs),  # type: ignore[attr-defined]
                             self.session, tools=tools)

    def _request(self, input: Any) -> dict[str, Any]:
        return chat_request(_as_messages(input), {"tools": self.tools} if self.tools else None)

    def _model(self, role: str) -> Runnable[Any, Any]:
        self.last_role = role
        return self.slow_model if role == "slow" else self.fast_model

    def _record(self, observation: Observation, answer: Any) -> Any:
        cached = cached_tokens(answer, None)
        if cached is not None:
            self.session.record_usage(observation.turn, cached_tokens=cached)
        return answer

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> BaseMessage:
        request = self._request(input)
        role = self.session.route(**request).role  # ContextOverflowError when no backend holds it
        observation = self.session.observe(sent_to=role, **request)
        return self._record(observation, self._model(role).invoke(input, config, **kwargs))

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> BaseMessage:
        request = self._request(input)
        role = (await self.session.aroute(**request)).role
        observation = await self.session.aobserve(sent_to=role, **request)
        return self._record(observation, await self._model(role).ainvoke(input, config, **kwargs))


def _as_messages(input: Any) -> list[BaseMessage]:
    if isinstance(input, str):
        return [HumanMessage(input)]
    if isinstance(input, PromptValue):
        return input.to_messages()
    return convert_to_messages(input)
