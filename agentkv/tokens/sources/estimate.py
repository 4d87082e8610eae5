"""Approximate counts: tiktoken over the ChatML template, with the interval the backend's exact count lies in.

    TiktokenSource().count(payload)        # total, safe (+15%), low/high
    estimate_interval(total, messages)     # (low, high)
"""

from __future__ import annotations

import math
import threading
from typing import Any, Mapping

from cachetools import LRUCache

from agentkv.events import digest
from agentkv.tokens.encodings import DEFAULT_ENCODING, get_encoding
from agentkv.tokens.incremental import JsonSnapshot, PrefixMemo
from agentkv.tokens.payload import Payload, TokenCount
from agentkv.tokens.sources.template import TemplateSource

__all__ = ["CROSS_TOKENIZER_MARGIN", "FIXED_SLACK", "PER_MESSAGE_SLACK", "TiktokenSource", "estimate_interval"]


class TiktokenSource:
    """Approximate counts: tiktoken on each message, plus the ChatML template's measured overheads.

    ``safe`` adds :data:`CROSS_TOKENIZER_MARGIN`, since the backend's own tokenizer may count more.

    Each message is counted once, memoised by its content; each distinct tool set once.
    """

    name = "tiktoken"

    def __init__(self, encoding: str = DEFAULT_ENCODING, maxsize: int = 65536) -> None:
        self._exact = TemplateSource(encoding, incremental=False)
        self._ordinary = get_encoding(encoding).encode_ordinary
        self._framing: dict[str, int] = {}  # tokens the ChatML template adds around a plain message, by role
        self._messages: LRUCache[str, int] = LRUCache(maxsize)
        self._tools: LRUCache[str, int] = LRUCache(256)
        self._lock = threading.Lock()
        # the last request's per-message counts, and its context (a snapshot: see TemplateSource._context)
        self._previous: PrefixMemo[int] = PrefixMemo(copy_context=False)
        self._last_context: JsonSnapshot | None = None
        self._last_tools: int | None = None
        self._priming: int | None = None

    def count(self, payload: Payload) -> TokenCount:
        if payload.messages is None:
            total = self._exact.count(payload).total
            return _estimate(total, 0, 1, self.name)
        context = self._snapshot((payload.tools, payload.tool_choice))
        kept, counts = self._previous.common(context, payload.messages)
        # kept > 0 means the same tools as the previous request: their count is reused without hashing
        tools = self._last_tools if kept and self._last_tools is not None else self._tools_tokens(payload)
        counts += [self._message_tokens(m) for m in payload.messages[kept:]]
        self._previous.store(context, payload.messages, kept, counts)
        self._last_tools = tools
        total = sum(counts) + self._reply_priming() + tools
        return _estimate(total, tools, len(counts), self.name)

    def _snapshot(self, context: tuple[Any, Any]) -> tuple[Any, Any]:
        """The previous request's own copy of ``context`` when equal (one comparison), else a new copy."""
        last = self._last_context
        if last is not None and last.matches(context):
            kept: tuple[Any, Any] = last.value  # the same object: the memo behind the count compares by identity
            return kept
        self._last_context = snapshot = JsonSnapshot(context)
        copied: tuple[Any, Any] = snapshot.value
        return copied

    def _message_tokens(self, message: Mapping[str, Any]) -> int:
        plain = _plain_text(message)
        if plain is not None and len(plain[1]) <= _UNCACHED_CHARS:
            return self._plain_tokens(*plain)  # a short plain message: counting it costs less than its digest
        key = digest(message, 24)
        with self._lock:
            cached = self._messages.get(key)
        if cached is None:
            cached = self._plain_tokens(*plain) if plain is not None else self._rendered_tokens(message)
            with self._lock:
                self._messages[key] = cached
        return cached

    def _rendered_tokens(self, message: Mapping[str, Any]) -> int:
        return self._exact.count(Payload((message,))).total - self._reply_priming()

    def _plain_tokens(self, role: str, content: str) -> int:
        """A plain message's count without rendering the template: its role's framing plus its content's tokens.
        Exact (equal to :meth:`_rendered_tokens`) because the content starts with no whitespace and ends with a
        letter or digit, so cl100k's pre-tokenizer cuts at both of its edges whether or not the framing is there."""
        framing = self._framing.get(role)
        if framing is None:
            framing = self._framing[role] = self._rendered_tokens({"role": role, "content": "A"}) - len(
                self._ordinary("A"))
        return framing + len(self._ordinary(content))

    def _tools_tokens(self, payload: Payload) -> int:
        if not payload.tools:
            return 0
        key = digest([payload.tools, payload.tool_choice], 24)
        with self._lock:
            cached = self._tools.get(key)
        if cached is None:
            cached = self._exact.count(Payload((), payload.tools, payload.tool_choice)).total - self._reply_priming()
            with self._lock:
                self._tools[key] = cached
        return cached

    def _reply_priming(self) -> int:
        if self._priming is None:
            self._priming = self._exact.count(Payload(())).total
        return self._priming


_PLAIN_ROLES = frozenset({"system", "user", "assistant", "tool"})
_UNCACHED_CHARS = 512


def _plain_text(message: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(role, content)`` of a message that is only a role and a string content, where the content starts with
    no whitespace and ends with a letter or digit (see :meth:`TiktokenSource._plain_tokens`); else None."""
    if type(message) is not dict or len(message) != 2:
        return None
    role, content = message.get("role"), message.get("content")
    if type(content) is not str or not content or role not in _PLAIN_ROLES:
        return None
    if content[0].isspace() or not content[-1].isalnum():
        return None
    return role, content


# cl100k is not the backend's tokenizer: other BPE vocabularies differ by up to ~15% on the same text.
CROSS_TOKENIZER_MARGIN = 0.15


# Beyond the proportional margin, another template may spend a different number of tokens on each
# message's framing (role headers, separators; ChatML written as text costs about 10 in cl100k, a
# special-token header 3 to 5) and on a fixed preamble (a default system prompt, a date line).
PER_MESSAGE_SLACK = 8
FIXED_SLACK = 32


def estimate_interval(total: int, messages: int) -> tuple[int, int]:
    """``(low, high)`` around a cl100k/ChatML estimate: the backend's exact count lies in it when its
    tokenizer counts the same text within :data:`CROSS_TOKENIZER_MARGIN` of cl100k either way and its
    template's framing differs by at most the slacks. ``benchmarks/count_bounds.py`` measures it."""
    slack = FIXED_SLACK + PER_MESSAGE_SLACK * messages
    low = math.floor(total / (1 + CROSS_TOKENIZER_MARGIN)) - slack
    return max(0, low), _with_margin(total) + slack


def _estimate(total: int, tools: int, messages: int, source: str) -> TokenCount:
    low, high = estimate_interval(total, messages)
    return TokenCount(total, _with_margin(total), tools, source, False, low, high)


def _with_margin(total: int) -> int:
    """The tiktoken count raised by the cross-tokenizer margin: the safe figure for clamping."""
    return math.ceil(total * (1 + CROSS_TOKENIZER_MARGIN))
