"""The conversation and tool list vLLM hands a chat template, built from an OpenAI request as vLLM 0.32 builds them.

A declared tokenizer and template count exactly only when the template sees what the server's template sees.
vLLM rebuilds each message (``renderers/chat_utils.py``: ``_parse_chat_message_content``,
``_postprocess_messages``; ``renderers/hf.py``) and each tool (``ChatCompletionToolsParam.model_dump()``):

- content becomes text parts; for a ``"string"`` template (:func:`~agentkv.tokens.content_format.detect_content_format`)
  they are joined with ``"\\n"`` (``None`` content is ``""``), for an ``"openai"`` one they stay a list of
  ``{"type": "text", "text": ...}`` (a string content too); a tool message's text parts are joined either way;
- only the fields vLLM carries survive: role and content; an assistant's ``tool_calls`` and ``reasoning``
  (also as ``reasoning_content``); a tool message's ``tool_call_id``; a string ``name`` or ``task``;
  a developer message's ``tools``;
- a tool call's ``arguments`` string is parsed to a dict (the template's ``tojson`` writes it again, with
  ``", "`` and ``": "`` separators: compact JSON counts differently); empty, unparsable or non-object
  arguments become ``{}``; an empty ``tool_calls`` list is dropped;
- developer messages become system messages, merged into one first message, when the template has no
  ``"developer"`` role;
- a tool is ``{"type", "function": {"name", "description", "parameters", ...}}`` in that order, ``description``
  and ``parameters`` written as ``null`` when absent, other keys dropped.

Media parts (images, audio) expand to tokens only the server knows: they raise
:class:`~agentkv.tokens.CountUnavailable` and the server counts. The caller's messages are never modified.

    conversation = vllm_conversation(messages, detect_content_format(template), template)
    tools = vllm_tools(tools)
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from agentkv.tokens.content_format import ContentFormat
from agentkv.tokens.payload import CountUnavailable

__all__ = ["TEXT_PART_TYPES", "vllm_conversation", "vllm_tools"]

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
"""Content-part types vLLM reads as text (``TEXT_PART_TYPES`` in ``renderers/chat_utils.py``)."""

_PART_TEXT_KEY = {"refusal": "refusal", "thinking": "thinking"}  # the others carry "text"
_SKIPPED_WHEN_EMPTY = ("text", "refusal")
# the content-part fields vLLM knows (``_KNOWN_CONTENT_PART_FIELDS``); others are kept on an "openai" part
_KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"})
_BILLING_HEADER = "x-anthropic-billing-header"
_TOOL_FIELDS = ("name", "description", "parameters")
_OPTIONAL_TOOL_FIELDS = ("strict", "defer_loading")


def vllm_conversation(messages: Sequence[Mapping[str, Any]], content_format: ContentFormat,
                      template: str = "") -> list[dict[str, Any]]:
    """The messages as vLLM renders them with a template of ``content_format`` (``template`` is read for a
    ``"developer"`` role)."""
    conversation = [_message(_plain(m), content_format) for m in messages]
    for message in conversation:
        _parse_tool_calls(message)
    if any(m["role"] == "developer" for m in conversation) and not _knows_developer(template):
        conversation = _merged_systems([_as_system(m) for m in conversation])
    return conversation


def vllm_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tool schemas as vLLM hands them to the template (``None`` without tools)."""
    if not tools:
        return None
    return [_tool(tool) for tool in tools]


def _message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    parts: Sequence[Any] = [] if content is None else [{"type": "text", "text": content}] if isinstance(
        content, str) else content
    if role == "system":
        parts = _without_billing_header(parts)
    texts = [text for text in (_part_text(part, content_format) for part in parts) if text is not None]
    result: dict[str, Any] = {"role": role, "content": "\n".join(texts) if content_format == "string" else texts}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = [_copied_call(call) for call in message["tool_calls"]]
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")  # vLLM's request model renames it
        if reasoning is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list) and all(part.get("type") == "text" for part in result["content"]):
            result["content"] = "\n".join(part["text"] for part in result["content"])
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _plain(value: Any) -> Any:
    """A message or tool call as a mapping: a pydantic message object (litellm's) dumped, anything else as it is."""
    dump = None if isinstance(value, Mapping) else getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def _part_text(part: Any, content_format: ContentFormat) -> Any:
    """A text part as the template sees it (a string, or a text-part dict for "openai"); None when vLLM skips
    it. Media parts cannot be counted here."""
    if isinstance(part, str):
        return part if content_format == "string" else {"type": "text", "text": part}
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind not in TEXT_PART_TYPES:
        raise CountUnavailable(f"a {kind!r} content part is counted by the server")
    text = part.get(_PART_TEXT_KEY.get(kind, "text"))
    if text is None and kind in _SKIPPED_WHEN_EMPTY:
        return None
    if not isinstance(text, str):
        raise CountUnavailable(f"a {kind!r} content part without text")
    if content_format == "string":
        return text
    return {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}}


def _without_billing_header(parts: Sequence[Any]) -> list[Any]:
    """System text parts without Claude Code's attribution line (vLLM drops it: it changes every request)."""
    kept: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) and part.get(
            "type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _copied_call(call: Any) -> Any:
    """A tool call copied down to its function, so that parsing the arguments leaves the caller's alone."""
    call = _plain(call)
    if not isinstance(call, Mapping):
        return call
    copied = dict(call)
    if isinstance(copied.get("function"), Mapping):
        copied["function"] = dict(copied["function"])
    return copied


def _parse_tool_calls(message: dict[str, Any]) -> None:
    """vLLM's ``_postprocess_messages``: an assistant's tool-call arguments as dicts; no empty ``tool_calls``."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise CountUnavailable("vLLM refuses a tool call that is not a function call")
        function["arguments"] = _arguments(function.get("arguments"))


def _arguments(arguments: Any) -> dict[str, Any]:
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _knows_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] != "developer":
        return message
    converted = {**message, "role": "system"}
    converted.pop("tools", None)
    return converted


def _merged_systems(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_consolidate_system_messages``: every system message merged into one first message, when one
    is not first or there are several."""
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise CountUnavailable("a tool without a function name is refused by vLLM")
    defined: dict[str, Any] = {key: function.get(key) for key in _TOOL_FIELDS}
    defer = tool.get("defer_loading")
    if defer is not None and function.get("defer_loading") is None:
        defined["defer_loading"] = defer
    for key in _OPTIONAL_TOOL_FIELDS:
        if function.get(key) is not None:
            defined[key] = function[key]
    if "defer_loading" in defined:  # keep the model's field order: name, description, parameters, strict, defer
        defined["defer_loading"] = defined.pop("defer_loading")
    result: dict[str, Any] = {"type": tool.get("type", "function"), "function": defined}
    if defer is not None:
        result["defer_loading"] = defer
    return result
