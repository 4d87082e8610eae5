"""What a request to a hosted provider carries so that its prompt cache is written by the warm and read by the
escalated turn, as each provider documents it. Pure: kwargs in, kwargs out (the caller's objects never edited).

- **Anthropic** caches only at ``cache_control`` breakpoints, at most :data:`MAX_BREAKPOINTS` a request, each
  reading the longest prefix written before (a 20-block lookback) and writing up to itself. A request is marked at
  its end (what the next request reads), at the end of the conversation's last cache write (the warm's, or the
  previous slow turn's: what this one reads), then the system prompt and the tools; the caller's own marks are
  kept and count toward the limit (:func:`anthropic_marked`).
- **OpenAI** caches automatically from 1,024 tokens and routes by ``prompt_cache_key``: every request of a
  conversation carries its routing key (an opaque per-tenant digest) unless the caller set one, and the backend's
  ``prompt_cache_retention`` (:func:`openai_keyed`).
- **Gemini** caches implicitly; with ``Backend(explicit_cache=True)`` the messages up to the conversation's last
  cache write are marked (:func:`gemini_marked`). The Session creates that explicit cache itself (at the warm) and
  every later request that marks the same prefix names it, sending only what follows it (:func:`gemini_named`); a
  request whose cache is gone is sent again whole (:func:`names_missing_cache`, :func:`gemini_unmarked`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

__all__ = ["MAX_BREAKPOINTS", "anthropic_marked", "caller_marks", "explicit_cache_moves", "gemini_marked",
           "gemini_named", "gemini_unmarked", "names_missing_cache", "openai_keyed"]

MAX_BREAKPOINTS = 4
"""Anthropic's limit of ``cache_control`` blocks in one request (a fifth is a 400)."""
# ----------------------------------------------------------------- Anthropic

def _mark(ttl: str | None) -> dict[str, str]:
    return {"type": "ephemeral", "ttl": ttl} if ttl and ttl != "5m" else {"type": "ephemeral"}


def _part_marks(parts: Any) -> int:
    return sum(1 for part in parts if isinstance(part, Mapping) and part.get("cache_control") is not None) \
        if isinstance(parts, list) else 0


def _item_marks(item: Any) -> int:
    """Marks on a message or a tool: its own, its content blocks', its tool calls', its function's."""
    if not isinstance(item, Mapping):
        return 0
    function = item.get("function")
    return (int(item.get("cache_control") is not None) + _part_marks(item.get("content"))
            + _part_marks(item.get("tool_calls"))
            + int(isinstance(function, Mapping) and function.get("cache_control") is not None))


def caller_marks(call: Mapping[str, Any]) -> int:
    """How many ``cache_control`` breakpoints the caller's request already carries to Anthropic: on messages, their
    content blocks and tool calls, on tools and their functions, a top-level ``cache_control``, the same inside
    ``extra_body``, and litellm's ``cache_control_injection_points``."""
    found = sum(_item_marks(item) for key in ("messages", "tools") for item in call.get(key) or [])
    found += int(call.get("cache_control") is not None)
    extra = call.get("extra_body")
    if isinstance(extra, Mapping):
        found += int(extra.get("cache_control") is not None)
        found += sum(_item_marks(item) for key in ("messages", "tools") for item in extra.get(key) or [])
    points = call.get("cache_control_injection_points")
    return found + (len(points) if isinstance(points, list) else 0)


def _caller_ttls(call: Mapping[str, Any]) -> set[str]:
    """The TTLs of the caller's own marks ("5m" where none is named), so that agentkv's keep Anthropic's order."""
    ttls: set[str] = set()

    def see(mark: Any) -> None:
        if isinstance(mark, Mapping):
            ttls.add(str(mark.get("ttl") or "5m"))

    for item in list(call.get("messages") or []) + list(call.get("tools") or []):
        if isinstance(item, Mapping):
            see(item.get("cache_control"))
            for key in ("content", "tool_calls"):
                parts = item.get(key)
                for part in parts if isinstance(parts, list) else []:
                    see(part.get("cache_control") if isinstance(part, Mapping) else None)
            see(item["function"].get("cache_control") if isinstance(item.get("function"), Mapping) else None)
    see(call.get("cache_control"))
    return ttls


def _marked(message: Mapping[str, Any], mark: Mapping[str, str]) -> dict[str, Any] | None:
    """A copy of ``message`` with a breakpoint at its end (its last content block, or the message itself, which
    litellm carries onto the text block it builds), or None when it already has one there or cannot take one: no
    text to carry it (an assistant turn of tool calls alone: litellm drops a mark there) or an empty last block."""
    content = message.get("content")
    if message.get("cache_control") is not None:
        return None
    if isinstance(content, list):
        last = content[-1] if content else None
        if not isinstance(last, Mapping) or last.get("cache_control") is not None or \
                (last.get("type") == "text" and not last.get("text")):
            return None
        return {**message, "content": [*content[:-1], {**last, "cache_control": dict(mark)}]}
    if isinstance(content, str) and content:
        return {**message, "cache_control": dict(mark)}
    return None


def _markable_at_or_before(messages: Sequence[Any], end: int) -> int | None:
    """The index of the last message before ``end`` that can carry a breakpoint."""
    for at in range(min(end, len(messages)) - 1, -1, -1):
        if isinstance(messages[at], Mapping) and _marked(messages[at], {"type": "ephemeral"}) is not None:
            return at
    return None


def _targets(messages: Sequence[Any], cache_end: int | None) -> list[int]:
    """Message indices to mark, most useful first: the request's end, the last write's end, the system prompt."""
    wanted = [_markable_at_or_before(messages, len(messages))]
    if cache_end is not None and 0 < cache_end < len(messages):
        wanted.append(_markable_at_or_before(messages, cache_end))
    systems = [i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "system"]
    if systems:
        wanted.append(_markable_at_or_before(messages, systems[-1] + 1))
    seen: list[int] = []
    for at in wanted:
        if at is not None and at not in seen:
            seen.append(at)
    return seen


def anthropic_marked(call: Mapping[str, Any], *, cache_end: int | None, ttl: str | None = None) -> dict[str, Any]:
    """``call`` with Anthropic ``cache_control`` breakpoints: at the request's end, the last cache write's end, the
    system prompt, then the last tool, as many as fit beside the caller's own marks in :data:`MAX_BREAKPOINTS`."""
    out = dict(call)
    budget = MAX_BREAKPOINTS - caller_marks(call)
    ttls = _caller_ttls(call)
    if len(ttls) > 1:  # the caller mixes lifetimes: Anthropic's order (1 h before 5 min) is theirs to keep
        return out
    messages = list(call.get("messages") or [])
    mark = _mark(ttls.pop() if ttls else ttl)
    for at in _targets(messages, cache_end):
        if budget <= 0:
            break
        marked = _marked(messages[at], mark)
        if marked is not None:
            messages[at], budget = marked, budget - 1
    if messages:
        out["messages"] = messages
    tools = list(call.get("tools") or [])
    if budget > 0 and tools and isinstance(tools[-1], Mapping) and tools[-1].get("cache_control") is None:
        out["tools"] = [*tools[:-1], {**tools[-1], "cache_control": dict(mark)}]
    return out


# ----------------------------------------------------------------- OpenAI

def openai_keyed(call: Mapping[str, Any], *, routing_key: str | None, retention: str | None) -> dict[str, Any]:
    """``call`` with the conversation's ``prompt_cache_key`` (a caller's own wins) and ``prompt_cache_retention``."""
    out = dict(call)
    if routing_key is not None and out.get("prompt_cache_key") is None:
        out["prompt_cache_key"] = routing_key
    if retention is not None and out.get("prompt_cache_retention") is None:
        out["prompt_cache_retention"] = retention
    return out


# ----------------------------------------------------------------- Gemini (explicit caches)

def gemini_marked(call: Mapping[str, Any], *, cache_end: int | None, ttl: str | None = None) -> dict[str, Any]:
    """``call`` with its messages up to the conversation's last cache write marked, through its last user turn
    (Gemini refuses a cache ending on a model turn): the Session caches the marked messages as one explicit cache, so
    the warm creates it and every later request that marks the same messages names it (:func:`gemini_named`).
    ``ttl`` rides on the first message's text block, where litellm's transformation reads it. A caller's own marks
    are left as they are (and cached the same way)."""
    messages = list(call.get("messages") or [])
    if cache_end is None or caller_marks(call) or not 0 < cache_end <= len(messages):
        return dict(call)
    users = [at for at in range(cache_end) if isinstance(messages[at], Mapping) and messages[at].get("role") == "user"]
    if not users:
        return dict(call)
    mark = {"type": "ephemeral", "ttl": ttl} if ttl else {"type": "ephemeral"}
    for at in range(users[-1] + 1):
        if isinstance(messages[at], Mapping):
            messages[at] = {**messages[at], "cache_control": dict(mark)}
    if ttl:
        messages[0] = _ttl_block(messages[0], mark)
    return {**call, "messages": messages}


def _ttl_block(message: Any, mark: Mapping[str, str]) -> Any:
    """``message`` with its text as a block carrying ``mark`` (litellm reads an explicit cache's TTL only there)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str) and content:
        return {**message, "content": [{"type": "text", "text": content, "cache_control": dict(mark)}]}
    if isinstance(content, list) and content and isinstance(content[-1], Mapping):
        return {**message, "content": [*content[:-1], {**content[-1], "cache_control": dict(mark)}]}
    return message


def explicit_cache_moves(usage: Any) -> bool:
    """Whether a slow turn's answer moves a conversation's Gemini explicit cache forward: when the prompt's uncached
    tail has grown as long as the cached prefix (a new cache then costs no more than the tail it saves re-reading,
    and a cache per turn would pay creation every turn). litellm counts a cache created on the way into the prompt:
    it is no tail."""
    prompt = getattr(usage, "prompt_tokens", None)
    cached = getattr(usage, "cached_tokens", None) or 0
    written = getattr(usage, "cache_write_tokens", None) or 0
    return isinstance(prompt, int) and prompt - written - cached >= cached


# What an explicit cache holds besides its messages: Gemini refuses them beside a ``cachedContent``.
_IN_THE_CACHE = ("tools", "tool_choice", "functions", "function_call")
_CACHED_CONTENT = re.compile(r"cached[\s_]?content", re.IGNORECASE)
_NOT_FOUND = re.compile(r"not[\s_]found", re.IGNORECASE)


def gemini_named(call: Mapping[str, Any], tail: Sequence[Any], name: str) -> dict[str, Any]:
    """``call`` reading the explicit cache ``name`` (``cachedContents/...``), which holds its cached messages, system
    prompt, tools and tool choice: only ``tail``, the messages after the cache, goes beside it."""
    out = {k: v for k, v in call.items() if k not in _IN_THE_CACHE}
    return {**out, "messages": list(tail), "cached_content": name}


def gemini_unmarked(call: Mapping[str, Any]) -> dict[str, Any]:
    """``call`` with no ``cache_control`` marks: sent whole, it neither creates nor names an explicit cache."""
    messages = call.get("messages")
    if not isinstance(messages, (list, tuple)):
        return dict(call)
    return {**call, "messages": [_unmarked(message) for message in messages]}


def _unmarked(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    out = {k: v for k, v in message.items() if k != "cache_control"}
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [{k: v for k, v in part.items() if k != "cache_control"} if isinstance(part, Mapping)
                          else part for part in content]
    return out


def names_missing_cache(status: object, text: str) -> bool:
    """Whether an error answer says the ``cachedContent`` a request named is gone (deleted, expired, or another
    key's): AI Studio answers 403 "CachedContent not found (or permission denied)", Vertex AI 404 NOT_FOUND."""
    return status in (403, 404) and _CACHED_CONTENT.search(text) is not None and _NOT_FOUND.search(text) is not None
