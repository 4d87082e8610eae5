"""Prefix-stability diagnostics: does this request extend the previous request's rendered token prefix?

A warm (or any prefix-cache hit) pays off only when the next request starts with the same full blocks.
Silent breakers: a timestamp in the system prompt, reordered or changed tools, a chat template that
re-renders earlier assistant turns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from agentkv.events import canonical_json

BLOCK_SIZE = 16
_TIMESTAMPISH = re.compile(r"\d{1,4}[-/:.]\d{1,2}[-/:.]\d{1,4}|\d{9,}")


@dataclass(frozen=True)
class PrefixReport:
    """How much of the previous request's rendered prefix the current request reuses.

    ``reusable_tokens``/``reusable_blocks``: the common token prefix (blocks of 16, what a prefix cache
    can hit); ``previous_tokens``: the previous prompt's length; ``divergence_message``: index of the
    first changed message (None: no message changed); ``divergence_block``: the 16-token block where the
    token streams part (None: the previous prompt is a full prefix); ``reason``: a short explanation;
    ``exact``: False when the tokens came from an approximate tokenizer.
    """

    reusable_tokens: int
    reusable_blocks: int
    previous_tokens: int
    divergence_message: int | None
    divergence_block: int | None
    reason: str
    exact: bool

    @property
    def intact(self) -> bool:
        """True when the whole previous prompt is a prefix of the current one."""
        return self.divergence_block is None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def explain_divergence(
    prev_messages: Sequence[Mapping[str, Any]],
    prev_tools: Sequence[Mapping[str, Any]] | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[int | None, str]:
    """The first changed message (or None) and a short reason, from the messages and tools themselves."""
    if [canonical_json(t) for t in prev_tools or []] != [canonical_json(t) for t in tools or []]:
        same_set = sorted(canonical_json(t) for t in prev_tools or []) == sorted(canonical_json(t) for t in tools or [])
        return None, "tools reordered" if same_set else "tools changed"
    for i, (old, new) in enumerate(zip(prev_messages, messages)):
        if canonical_json(old) != canonical_json(new):
            return i, _message_change(i, old, new)
    if len(messages) < len(prev_messages):
        return len(messages), "messages removed"
    return None, ""


def _message_change(index: int, old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    role = old.get("role")
    if role == "system":
        stamps = _TIMESTAMPISH.findall(str(old.get("content"))) != _TIMESTAMPISH.findall(str(new.get("content")))
        return "system prompt changed (a timestamp or date differs)" if stamps else "system prompt changed"
    if role == "assistant":
        return f"earlier assistant turn {index} changed"
    return f"message {index} ({role}) changed"


def build_report(
    prev_ids: Sequence[int],
    ids: Sequence[int],
    divergence: tuple[int | None, str],
    *,
    exact: bool,
    block_size: int = BLOCK_SIZE,
) -> PrefixReport:
    """Combine the token comparison with the message-level explanation."""
    common = common_prefix(prev_ids, ids)
    blocks = common // block_size
    message, reason = divergence
    if common >= len(prev_ids):
        return PrefixReport(common, blocks, len(prev_ids), message, None, reason or "prefix intact", exact)
    reason = reason or "the chat template re-rendered earlier turns"
    return PrefixReport(common, blocks, len(prev_ids), message, common // block_size, reason, exact)
