"""Messages as vLLM hands them to a chat template: content parts joined or kept, tool-call arguments parsed.

vLLM 0.32 (``vllm/renderers/hf.py``, ``vllm/renderers/chat_utils.py``) first decides from the template's Jinja AST
whether it iterates over ``message.content`` (format ``"openai"``) or not (``"string"``). Then, per message:

- ``"string"``: the text parts are joined with ``"\\n"`` into one string (null content becomes ``""``);
- ``"openai"``: the content is a list of ``{"type": "text", "text": ...}`` parts (a plain string becomes one part);
- a ``tool`` message's list of text parts is joined with ``"\\n"`` in either format;
- an assistant's ``tool_calls`` get their ``arguments`` JSON string parsed to a dict (invalid or non-object JSON
  becomes ``{}``), and an empty ``tool_calls`` list is dropped.

Pure functions; the AST walk (a port of vLLM's ``_detect_content_format``) is the token counter's.

Usage::

    fmt = content_format(tokenizer.chat_template)            # "string" or "openai"
    tokenizer.apply_chat_template(template_messages(messages, fmt), ...)
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from agentkv.tokens.content_format import ContentFormat, detect_content_format

__all__ = ["ContentFormat", "content_format", "template_messages"]

_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


def content_format(template: str | None) -> ContentFormat:
    """``"openai"`` when ``template`` loops over a message's content, else ``"string"`` (vLLM's default; also
    for no template): the detection the token counter uses, :func:`agentkv.tokens.content_format.detect_content_format`."""
    return detect_content_format(template) if template else "string"


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
