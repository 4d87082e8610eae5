"""A small ReAct loop over a Session: call the model through its routing, run the tools it asks for.

    def get_weather(city: str) -> str:
        '''Current weather in a city.

        Args:
            city: The city's name.
        '''
        return "sunny"

    result = session.react("Weather in Paris?", [get_weather], max_steps=8, max_tokens=512)
    result.content, result.steps, result.stop_reason, result.messages

Each step sends the whole conversation through :meth:`Session.completion` (so it is counted, routed,
warmed and clamped like any other request), appends the assistant's message, runs every tool call it
carries and appends one ``tool`` message per call. The loop stops at a message without tool calls
(``"final_answer"``) or after ``max_steps`` model calls (``"max_steps"``; that step's tool calls are
still answered, so ``result.messages`` is a valid conversation to continue).

A tool that raises, an unknown tool name and arguments that are not a JSON object all become a
``tool`` message starting with ``error:``, so the model can correct itself; nothing crashes the loop.
``arun_loop`` awaits async tools and calls sync tools directly (no thread pool).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from agentkv.wire.usage import read_field
from agentkv.errors import ConfigurationError
from agentkv.events import emit
from agentkv.protocols import SessionLike
from agentkv.routing import RouteDecision
from agentkv.toolschema import function_schema, is_tool_schema

StopReason = Literal["final_answer", "max_steps"]


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the schema it is advertised under.

    ``Tool.of(func)`` derives the schema from the signature and docstring; pass ``schema=`` to
    advertise an explicit one.
    """

    name: str
    func: Callable[..., Any]
    schema: Mapping[str, Any]

    @classmethod
    def of(cls, func: Callable[..., Any], *, name: str | None = None,
           schema: Mapping[str, Any] | None = None) -> Tool:
        schema = schema or function_schema(func, name=name)
        if not is_tool_schema(schema):
            raise ConfigurationError(f"not an OpenAI tool schema: {schema!r}")
        return cls(name or schema["function"]["name"], func, schema)

    @property
    def is_async(self) -> bool:
        """True for a coroutine function, or an object whose ``__call__`` is one."""
        return inspect.iscoroutinefunction(self.func) or inspect.iscoroutinefunction(type(self.func).__call__)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message: its id, the tool's name and the raw arguments."""

    id: str
    name: str
    arguments: Any


@dataclass
class RunResult:
    """What a loop produced: the final assistant message, the whole conversation, steps and why it stopped."""

    final: dict[str, Any]
    messages: list[dict[str, Any]]
    steps: int
    stop_reason: StopReason
    routes: list[RouteDecision | None] = field(default_factory=list)

    @property
    def content(self) -> Any:
        """The final assistant message's content."""
        return self.final.get("content")


# ----------------------------------------------------------------------------- pure helpers
def toolset(tools: Any) -> dict[str, Tool]:
    """Tools by name, from ``{name: callable}``, or a list of callables, :class:`Tool` objects and schemas.

    A schema dict in a list replaces the derived schema of the callable with the same name.
    """
    if not tools:
        return {}
    if isinstance(tools, Mapping):  # keys name plain callables; a Tool keeps its own name
        made = [t if isinstance(t, Tool) else Tool.of(t, name=name) for name, t in tools.items()]
        return {tool.name: tool for tool in made}
    schemas = {s["function"]["name"]: s for s in tools if is_tool_schema(s)}
    found: dict[str, Tool] = {}
    for entry in tools:
        if is_tool_schema(entry):
            continue
        if not isinstance(entry, Tool) and not callable(entry):
            raise ConfigurationError(f"a tool must be a callable, a Tool or a tool schema, got {type(entry).__name__}")
        tool = entry if isinstance(entry, Tool) else Tool.of(entry)
        found[tool.name] = Tool.of(tool.func, name=tool.name, schema=schemas.pop(tool.name, tool.schema))
    if schemas:
        raise ConfigurationError(f"tool schema(s) {sorted(schemas)} have no callable of the same name")
    return found


def opening(user_message: Any, system: str | None, messages: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation a loop starts from: the system prompt (unless ``messages`` has one), history, the user turn."""
    history = [dict(m) for m in messages or ()]
    if system is not None and not (history and history[0].get("role") == "system"):
        history.insert(0, {"role": "system", "content": system})
    if user_message is not None:
        history.append(dict(user_message) if isinstance(user_message, Mapping)
                       else {"role": "user", "content": user_message})
    if not history:
        raise ValueError("a ReAct loop needs a user message or messages")
    return history


def assistant_message(response: Any, step: int) -> dict[str, Any]:
    """The first choice's message as a plain dict; tool calls without an id get ``call_<step>_<i>``."""
    choices = read_field(response, "choices") or []
    if not choices:
        raise ValueError("the model's response has no choices")
    message = read_field(choices[0], "message")
    out: dict[str, Any] = {"role": "assistant", "content": read_field(message, "content") or ""}
    calls = []
    for i, call in enumerate(read_field(message, "tool_calls") or []):
        function = read_field(call, "function")
        arguments = read_field(function, "arguments")
        calls.append({"id": read_field(call, "id") or f"call_{step}_{i}", "type": "function", "function": {
            "name": read_field(function, "name") or "",
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments or {})}})
    if calls:
        out["tool_calls"] = calls
    return out


def tool_calls(message: Mapping[str, Any]) -> list[ToolCall]:
    """The tool calls an assistant message (as built by :func:`assistant_message`) carries."""
    return [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]


def resolve(call: ToolCall, tools: Mapping[str, Tool]) -> tuple[Tool, dict[str, Any]] | str:
    """The tool and its keyword arguments, or the error text to answer the call with."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; available tools: {', '.join(sorted(tools)) or 'none'}"
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError as exc:
        return f"error: the arguments of {call.name!r} are not valid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(arguments, dict):
        return f"error: the arguments of {call.name!r} must be a JSON object, got {type(arguments).__name__}"
    return tool, arguments


def tool_message(call: ToolCall, content: str) -> dict[str, Any]:
    """The ``tool`` message answering ``call``."""
    return {"role": "tool", "tool_call_id": call.id, "content": content}


def render(value: Any) -> str:
    """A tool's return value as message content: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def failure(tool: Tool, exc: Exception) -> str:
    """The tool message content for a tool that raised (logged with the error type, not its arguments)."""
    emit("tool_error", level="warning", tool=tool.name, error=type(exc).__name__)
    return f"error: {tool.name} raised {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- the loop state
class _Loop:
    """The conversation and bookkeeping both drivers share; the drivers only call the model and the tools."""

    def __init__(self, user_message: Any, tools: Any, max_steps: int, system: str | None,
                 messages: Sequence[Mapping[str, Any]] | None, completion_kwargs: dict[str, Any]) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        self.tools = toolset(tools)
        self.max_steps = max_steps
        self.messages = opening(user_message, system, messages)
        self.kwargs = completion_kwargs
        self.routes: list[RouteDecision | None] = []
        self.last: dict[str, Any] = {}

    def request(self) -> dict[str, Any]:
        schemas = [dict(t.schema) for t in self.tools.values()]
        return {**self.kwargs, "messages": self.messages, **({"tools": schemas} if schemas else {})}

    def take(self, response: Any, route: RouteDecision | None) -> list[ToolCall]:
        self.last = assistant_message(response, len(self.routes) + 1)
        self.messages.append(self.last)
        self.routes.append(route)
        return tool_calls(self.last)

    def answer(self, call: ToolCall, content: str) -> None:
        self.messages.append(tool_message(call, content))

    def result(self, stop_reason: StopReason) -> RunResult:
        emit("react_done", steps=len(self.routes), stop_reason=stop_reason, messages=len(self.messages))
        return RunResult(self.last, self.messages, len(self.routes), stop_reason, self.routes)


# ----------------------------------------------------------------------------- the drivers
def run_loop(session: SessionLike, user_message: Any, tools: Any = None, *, max_steps: int = 20, system: str | None = None,
             messages: Sequence[Mapping[str, Any]] | None = None, **completion_kwargs: Any) -> RunResult:
    """Run a ReAct loop through ``session.completion``; ``completion_kwargs`` pass through to every call."""
    loop = _Loop(user_message, tools, max_steps, system, messages, completion_kwargs)
    asynchronous = sorted(name for name, tool in loop.tools.items() if tool.is_async)
    if asynchronous:
        raise ConfigurationError(f"tools {asynchronous} are async: use arun_loop / Session.areact")
    for _ in range(max_steps):
        calls = loop.take(session.completion(**loop.request()), session.last_route)
        if not calls:
            return loop.result("final_answer")
        for call in calls:
            loop.answer(call, _run_sync(resolve(call, loop.tools)))
    return loop.result("max_steps")


async def arun_loop(session: SessionLike, user_message: Any, tools: Any = None, *, max_steps: int = 20,
                    system: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None,
                    **completion_kwargs: Any) -> RunResult:
    """The async twin of :func:`run_loop`: ``session.acompletion``, async tools awaited."""
    loop = _Loop(user_message, tools, max_steps, system, messages, completion_kwargs)
    for _ in range(max_steps):
        calls = loop.take(await session.acompletion(**loop.request()), session.last_route)
        if not calls:
            return loop.result("final_answer")
        for call in calls:
            loop.answer(call, await _run_async(resolve(call, loop.tools)))
    return loop.result("max_steps")


def _run_sync(resolved: tuple[Tool, dict[str, Any]] | str) -> str:
    if isinstance(resolved, str):
        return resolved
    tool, arguments = resolved
    try:
        return render(tool.func(**arguments))
    except Exception as exc:  # a failing tool is the model's problem to solve, not the loop's
        return failure(tool, exc)


async def _run_async(resolved: tuple[Tool, dict[str, Any]] | str) -> str:
    if isinstance(resolved, str):
        return resolved
    tool, arguments = resolved
    try:
        value = tool.func(**arguments)
        return render(await value if inspect.isawaitable(value) else value)
    except Exception as exc:  # a failing tool is the model's problem to solve, not the loop's
        return failure(tool, exc)
