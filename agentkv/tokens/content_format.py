"""What a chat template does with ``message.content``, read from its syntax tree as vLLM reads it.

vLLM hands a template each message's content in one of two shapes (``renderers/hf.py``,
``_detect_content_format``): ``"openai"``, a list of parts (``[{"type": "text", "text": ...}]``), when the
template loops over a message's content somewhere; ``"string"``, the text parts joined with ``"\\n"``,
otherwise (and when the template cannot be parsed). The walk below finds those loops the way vLLM's does:
loops over ``messages`` (or names assigned from it) give message names; a loop over ``<message>.content``
(also through a filter, a test or a slice), over a macro parameter that receives it, or over a name
``content`` outside macros, is a content loop.

:func:`references_field` answers a simpler question of the same tree: does the template read a message
field (``tool_call_id``) at all?

    detect_content_format(template)             # "string" or "openai"
    references_field(template, "tool_call_id")  # True when the template reads it
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Any, Iterator, Literal

__all__ = ["ContentFormat", "detect_content_format", "references_field"]

ContentFormat = Literal["string", "openai"]


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """``"openai"`` when ``template`` iterates over a message's content, else ``"string"`` (vLLM's default,
    also for a template that does not parse)."""
    tree = _parse(template)
    if tree is None:
        return "string"
    try:
        return "openai" if next(_content_loops(tree), None) is not None else "string"
    except _Unreadable:  # vLLM's walk fails on a loop or assignment it cannot name, and says "string"
        return "string"


@lru_cache(maxsize=32)
def references_field(template: str, field: str) -> bool:
    """Whether ``template`` reads ``field`` of anything (``x.field`` or ``x['field']``); a template that does
    not parse is searched as text."""
    tree = _parse(template)
    if tree is None:
        return field in template
    from jinja2 import nodes

    return any(node.attr == field for node in tree.find_all(nodes.Getattr)) or any(
        isinstance(node.arg, nodes.Const) and node.arg.value == field for node in tree.find_all(nodes.Getitem))


def _parse(template: str) -> Any:
    """The template's syntax tree (HF's chat-template syntax: loop controls, ``{% generation %}``), or None."""
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag), parsed as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    try:
        return env.parse(template)
    except (TemplateError, ValueError, TypeError):
        return None


class _Unreadable(Exception):
    """A loop over messages or content, or an assignment from messages, whose target is not one name."""


def _target(node: Any) -> str:
    from jinja2 import nodes

    if not isinstance(node, nodes.Name):
        raise _Unreadable(type(node).__name__)
    return str(node.name)


def _is_name(node: Any, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_field(node: Any, name: str, key: str) -> bool:
    """``name.key`` or ``name['key']``."""
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key``), seen through filters, tests and slices (``messages[1:] | reverse``)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_field(node, name, key) if key else _is_name(node, name)


def _aliases(tree: Any, name: str) -> Iterator[str]:
    """``name`` and every name assigned from it, directly or through another alias (breadth first)."""
    from jinja2 import nodes

    yield name
    pending, seen = deque([name]), {name}
    while pending:
        current = pending.popleft()
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, current):
                target = _target(assign.target)
                if target not in seen:
                    seen.add(target)
                    pending.append(target)
                    yield target


def _message_names(tree: Any) -> list[str]:
    """The loop variables of loops over ``messages`` (or an alias of it)."""
    from jinja2 import nodes

    sources = list(_aliases(tree, "messages"))
    return [_target(loop.target) for loop in tree.find_all(nodes.For) if any(_reads(loop.iter, name) for name in sources)]


def _content_loops(tree: Any) -> Iterator[Any]:
    """Loops over a message's content: ``for part in message.content``, over a macro parameter that receives
    ``message.content``, or over a name ``content`` outside any macro."""
    from jinja2 import nodes

    messages = _message_names(tree)
    params_by_loop, in_macros = _macro_content_params(tree, messages)
    for loop in tree.find_all(nodes.For):
        over_name = isinstance(loop.iter, nodes.Name)
        if (any(_reads(loop.iter, name, "content") for name in messages)
                or (over_name and loop.iter.name in params_by_loop.get(id(loop), ()))
                or (over_name and id(loop) not in in_macros and loop.iter.name == "content")):
            _target(loop.target)
            yield loop


def _macro_content_params(tree: Any, messages: list[str]) -> tuple[dict[int, set[str]], set[int]]:
    """For each loop inside a macro, the macro's parameters that some call passes ``<message>.content``; and
    the ids of all loops inside macros."""
    from jinja2 import nodes

    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    calls = list(tree.find_all(nodes.Call))
    for macro in tree.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in calls:
            if not _is_name(call.node, macro.name):
                continue
            params |= {names[i] for i, arg in enumerate(call.args)
                       if i < len(names) and any(_reads(arg, m, "content") for m in messages)}
            params |= {kw.key for kw in call.kwargs
                       if kw.key in names and any(_reads(kw.value, m, "content") for m in messages)}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    return params_by_loop, in_macros
