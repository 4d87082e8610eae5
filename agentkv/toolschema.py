"""OpenAI-style tool schemas from Python callables: type hints plus a Google-style docstring.

The same shape ``transformers.utils.get_json_schema`` produces, without importing transformers:

    def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
        '''Current weather in a city.

        Args:
            city: The city's name.
            unit: Temperature unit.
        '''

    function_schema(get_weather)
    # {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
    #   "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": ...},
    #                  "unit": {"type": "string", "enum": ["c", "f"], "description": ...}}, "required": ["city"]}}}

Differences from transformers, on purpose: a missing docstring or argument description leaves the
description out instead of raising (the model sees less, nothing breaks); the return annotation is
not put in the schema (``"return"`` is not part of the OpenAI tool format and strict servers reject
it); ``*args``/``**kwargs`` are skipped. Every other parameter needs a type hint.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

from agentkv.errors import ConfigurationError

_SCALARS: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE: dict[Any, dict[str, Any]] = {
    **{t: {"type": name} for t, name in _SCALARS.items()},
    list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}, Any: {},
}
_SECTION = r"(?:Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):"
_DESCRIPTION_RE = re.compile(rf"^(.*?)[\n\s]*(?:{_SECTION}|\Z)", re.DOTALL)
_ARGS_RE = re.compile(rf"\n\s*(?:Args|Arguments):\n(.*?)[\n\s]*(?:{_SECTION}|\Z)", re.DOTALL)
_ARG_RE = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL,
)
_CHOICES_RE = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


class ToolSchemaError(ConfigurationError):
    """A callable's signature cannot be turned into a JSON schema (a missing or unsupported type hint)."""


def function_schema(func: Callable[..., Any], *, name: str | None = None) -> dict[str, Any]:
    """The OpenAI tool schema of ``func``: its name (or ``name``), docstring and typed parameters."""
    fname = name or getattr(func, "__name__", "tool")
    summary, arg_docs = parse_docstring(inspect.getdoc(func) or "")
    parameters = _parameters(func, fname, arg_docs)
    function: dict[str, Any] = {"name": fname}
    if summary:
        function["description"] = summary
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's summary and its ``Args:`` descriptions (one line each)."""
    doc = doc.strip()
    found = _DESCRIPTION_RE.search(doc)
    summary = found.group(1).strip() if found else ""
    block = _ARGS_RE.search(doc)
    if block is None:
        return summary, {}
    lines = "\n".join(line for line in block.group(1).split("\n") if line.strip())
    return summary, {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG_RE.findall(lines)}


def json_type(hint: Any) -> dict[str, Any]:
    """The JSON schema of one type hint (basic types, Enum, Literal, list, tuple, dict, Union/Optional)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum([member.value for member in hint], hint)
    if origin is None:
        if hint in _BARE:
            return dict(_BARE[hint])
        raise ToolSchemaError(f"type hint {hint!r} has no JSON schema; pass an explicit schema for this tool")
    if origin is Union or origin is getattr(types, "UnionType", None):
        return _union(args)
    if origin is Literal:
        return _enum(list(args), hint)
    if origin is list:
        return {"type": "array", "items": json_type(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is ...:  # tuple[int, ...]: any length
            return {"type": "array", "items": json_type(args[0])}
        return {"type": "array", "prefixItems": [json_type(a) for a in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": json_type(args[1])} if len(args) == 2 else {"type": "object"}
    raise ToolSchemaError(f"type hint {hint!r} has no JSON schema; pass an explicit schema for this tool")


def _union(args: tuple[Any, ...]) -> dict[str, Any]:
    subtypes = [json_type(a) for a in args if a is not type(None)]
    if len(subtypes) == 1:
        out = subtypes[0]
    elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
        names = sorted({s["type"] for s in subtypes})
        out = {"type": names[0] if len(names) == 1 else names}
    else:
        out = {"anyOf": subtypes}
    if type(None) in args:
        out["nullable"] = True
    return out


def _enum(values: list[Any], hint: Any) -> dict[str, Any]:
    if not values or any(type(v) not in _SCALARS for v in values):
        raise ToolSchemaError(f"{hint!r}: enum values must be int, float, str, bool or None, and at least one")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _parameters(func: Callable[..., Any], fname: str, arg_docs: Mapping[str, str]) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:  # an unresolvable forward reference: say which tool
        raise ToolSchemaError(f"cannot resolve the type hints of tool {fname!r}: {exc}") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in _user_parameters(func):
        if pname not in hints:
            raise ToolSchemaError(f"argument {pname!r} of tool {fname!r} has no type hint")
        schema = json_type(hints[pname])
        _describe(schema, arg_docs.get(pname))
        properties[pname] = schema
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def _user_parameters(func: Callable[..., Any]) -> list[tuple[str, inspect.Parameter]]:
    params = list(inspect.signature(func).parameters.items())
    if params and params[0][0] in ("self", "cls") and params[0][1].annotation is inspect.Parameter.empty:
        params = params[1:]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [(n, p) for n, p in params if p.kind not in variadic]


def _describe(schema: dict[str, Any], doc: str | None) -> None:
    if not doc:
        return
    choices = _CHOICES_RE.search(doc)
    if choices:
        schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
        doc = doc[: choices.start()].strip()
    schema["description"] = doc


def is_tool_schema(value: Any) -> bool:
    """True for an OpenAI tool schema dict (``{"type": "function", "function": {"name": ...}}``)."""
    return (isinstance(value, Mapping) and value.get("type") == "function"
            and isinstance(value.get("function"), Mapping) and bool(value["function"].get("name")))
