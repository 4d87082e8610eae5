"""Messages as vLLM hands them to a chat template: content parts joined or kept, tool-call arguments parsed.

vLLM 0.32 (``vllm/renderers/hf.py``, ``vllm/renderers/chat_utils.py``) first decides from the template's Jinja AST
whether it iterates over ``message.content`` (format ``"openai"``) or not (``"string"``). Then, per message:

- ``"string"``: the text parts are joined with ``"\\n"`` into one string (null content becomes ``""``);
- ``"openai"``: the content is a list of ``{"type": "text", "text": ...}`` parts (a plain string becomes one part);
- a ``tool`` message's list of text parts is joined with ``"\\n"`` in either format;
- an assistant's ``tool_calls`` get their ``arguments`` JSON string parsed to a dict (invalid or non-object JSON
  becomes ``{}``), and an empty ``tool_calls`` list is dropped.

Pure functions; the AST walk is a port of vLLM's ``_detect_content_format``.

Usage::

    fmt = content_format(tokenizer.chat_template)            # "string" or "openai"
    tokenizer.apply_chat_template(template_messages(messages, fmt), ...)
"""

from __future__ import annotations

import json
from collections import deque
from functools import lru_cache
from typing import Any, Iterator, Literal, Mapping, Sequence

ContentFormat = Literal["string", "openai"]

__all__ = ["ContentFormat", "content_format", "template_messages"]

_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


@lru_cache(maxsize=32)
def content_format(template: str | None) -> ContentFormat:
    """``"openai"`` when ``template`` loops over a message's content, else ``"string"`` (vLLM's default)."""
    if not template:
        return "string"
    try:
        import jinja2.nodes  # noqa: F401
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ast = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except Exception:  # noqa: BLE001 - vLLM falls back to "string" for a template it cannot parse
        return "string"
    return "openai" if next(_content_loops(ast), None) is not None else "string"


def _is_var(node: Any, name: str) -> bool:
    import jinja2.nodes as nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str) -> bool:
    import jinja2.nodes as nodes

    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_access(node: Any, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key``), possibly through a filter, a test or a slice."""
    import jinja2.nodes as nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_access(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_access(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: Any, name: str) -> list[str]:
    """``name`` and every variable assigned from it (or its elements), transitively."""
    import jinja2.nodes as nodes

    found, queue = [name], deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_access(assign.node, current) and isinstance(assign.target, nodes.Name):
                found.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    return found


def _message_loop_vars(root: Any) -> list[str]:
    """The targets of ``{% for message in messages %}`` loops (over ``messages`` or an alias of it)."""
    import jinja2.nodes as nodes

    names = _aliases(root, "messages")
    return [loop.target.name for loop in root.find_all(nodes.For)
            if isinstance(loop.target, nodes.Name) and any(_is_access(loop.iter, n) for n in names)]


def _macro_content_params(root: Any, message_vars: Sequence[str]) -> tuple[dict[int, set[str]], set[int]]:
    """Per loop inside a macro, the macro's parameters that receive ``message.content``; and all such loops."""
    import jinja2.nodes as nodes

    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        receiving: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_is_access(arg, v, "content") for v in message_vars):
                    receiving.add(params[i])
            for kwarg in call.kwargs:
                if kwarg.key in params and any(_is_access(kwarg.value, v, "content") for v in message_vars):
                    receiving.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if receiving:
                by_loop[id(loop)] = receiving
    return by_loop, in_macros


def _content_loops(root: Any) -> Iterator[Any]:
    """Loops over ``message.content``, over a macro parameter bound to it, or over a top-level ``content``."""
    import jinja2.nodes as nodes

    message_vars = _message_loop_vars(root)
    by_loop, in_macros = _macro_content_params(root, message_vars)
    for loop in root.find_all(nodes.For):
        if any(_is_access(loop.iter, v, "content") for v in message_vars):
            yield loop
        elif isinstance(loop.iter, nodes.Name) and loop.iter.name in by_loop.get(id(loop), ()):
            yield loop
        elif id(loop) not in in_macros and isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            yield loop


def _texts(content: Any) -> list[str]:
    """The text of each text part (a plain string is one part; null is none)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content
            if isinstance(p, str) or (isinstance(p, Mapping) and p.get("type", "text") in _TEXT_PARTS)]


def _arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments as the dict vLLM renders: parsed JSON, ``{}`` when absent, invalid or no object."""
    if not raw:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return dict(raw) if isinstance(raw, Mapping) else {}


def _tool_calls(calls: Any) -> list[Any] | None:
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        call = dict(call)
        function = call.get("function")
        if isinstance(function, Mapping):
            call["function"] = {**function, "arguments": _arguments(function.get("arguments"))}
        out.append(call)
    return out


def template_messages(messages: Sequence[Mapping[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """Plain-dict copies of ``messages`` as vLLM passes them to a template of format ``fmt``."""
    out = []
    for message in messages:
        role = message.get("role")
        texts = _texts(message.get("content"))
        converted: dict[str, Any] = {"role": role}
        if role == "tool" or fmt == "string":
            converted["content"] = "\n".join(texts)
        else:
            converted["content"] = [{"type": "text", "text": t} for t in texts]
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"))
            if calls is not None:
                converted["tool_calls"] = calls
            if message.get("reasoning") is not None:
                converted["reasoning"] = converted["reasoning_content"] = message["reasoning"]
        if role == "tool" and "tool_call_id" in message:
            converted["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            converted["name"] = message["name"]
        out.append(converted)
    return out
