"""Tool calls as vLLM makes them: parsed from hermes ``<tool_call>`` blocks, or forced with structured outputs.

``tool_choice="auto"``: the text is scanned for ``<tool_call>{"name", "arguments"}</tool_call>`` blocks
(vLLM's hermes parser). ``tool_choice="required"``: generation is constrained to a JSON array of
``{"name", "parameters"}`` objects, one schema branch per tool; a named function: constrained to that function's
parameters schema, and the whole output becomes its arguments. Pure functions only.

Usage::

    spec = forced_tool_spec(tools, "required")          # a GrammarSpec, or None for "auto"/"none"
    content, calls = tool_calls_from_output(text, tools, "required")
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator, Mapping, Sequence

from agentkv.embedded.engine.grammar import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def named_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` object names, or None."""
    if isinstance(tool_choice, Mapping):
        return str(tool_choice["function"]["name"])
    function = getattr(tool_choice, "function", None)
    return getattr(function, "name", None)


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    return dict(tool["function"].get("parameters") or _ANY_OBJECT)


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice="required"``: a non-empty array of calls to the given tools.

    Each tool's ``$defs`` move to the root, as vLLM does, so ``#/$defs/...`` references still resolve.
    """
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        parameters = _parameters(tool)
        defs.update(parameters.pop("$defs", None) or {})
        branches.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_tool_spec(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                     parallel: bool = True) -> GrammarSpec | None:
    """The constraint that enforces ``tool_choice`` (None for ``auto``/``none``)."""
    if not tools:
        return None
    if tool_choice == "required":
        return GrammarSpec("json", required_schema(tools, parallel))
    name = named_function(tool_choice)
    if name is None:
        return None
    tool = next(t for t in tools if t["function"]["name"] == name)
    return GrammarSpec("json", _parameters(tool))


def call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def hermes_blocks(text: str) -> Iterator[str]:
    """The text of each ``<tool_call>...</tool_call>`` block, and of a final block left open to the end.

    What vLLM's ``<tool_call>(.*?)</tool_call>|<tool_call>(.*)`` finds, by scanning forward with ``str.find``:
    time linear in ``len(text)`` whatever the model wrote (the regex with ``\\s*`` around a lazy group was cubic:
    ``<tool_call>`` and 4,000 spaces took 26 s).
    """
    start = text.find(OPEN)
    while start >= 0:
        body = start + len(OPEN)
        end = text.find(CLOSE, body)
        if end < 0:
            yield text[body:]
            return
        yield text[body:end]
        start = text.find(OPEN, end + len(CLOSE))


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split ``<tool_call>{json}</tool_call>`` blocks out of ``text``, as vLLM's hermes parser does.

    Returns the remaining content (None when nothing is left) and the calls; text whose blocks do not all
    parse is returned unchanged with no calls.
    """
    calls = []
    for raw in hermes_blocks(text):
        try:
            parsed = json.loads(raw)
            name, arguments = parsed["name"], parsed.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        calls.append(call(name, json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.find(OPEN)].strip()
    return content or None, calls


def tool_calls_from_output(text: str, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                           finish_reason: str = "stop") -> tuple[str | None, list[dict[str, Any]]]:
    """The message content and tool calls of a finished output under ``tool_choice``.

    A forced call cut off by ``max_tokens`` (finish_reason ``length``) gives no tool calls and empty content,
    as vLLM (and OpenAI) answer.
    """
    if not tools or tool_choice == "none":
        return text, []
    forced = tool_choice == "required" or named_function(tool_choice) is not None
    if forced and finish_reason == "length":
        return "", []
    if tool_choice == "required":
        try:
            items = json.loads(text)
            return None, [call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        except (ValueError, KeyError, TypeError):
            return text, []
    name = named_function(tool_choice)
    if name is not None:
        return "", [call(name, text)]
    return parse_hermes(text)
