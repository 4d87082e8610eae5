"""A hard upper bound on a payload's exact count that holds whatever the backend's tokenizer: its UTF-8 bytes.

Every token of a byte-level BPE, a SentencePiece model with byte fallback or a WordPiece vocabulary covers at
least one byte of the text it encodes, so a text of ``n`` UTF-8 bytes is at most ``n`` tokens, however far the
tokenizer's ratio is from cl100k's. The chat template adds its framing: the ceiling counts the payload as its
canonical JSON (each message's keys, quotes and braces, about 28 bytes a message, stand in for the role header
and separators) plus the estimate's own slacks and, with tool schemas, :data:`TOOLS_PREAMBLE` for a template's
tool instructions. A payload with anything but text (an image, audio or a file part: hundreds of tokens from a
short URL) has no ceiling.

The ceiling is what lets a backend whose tokenizer ratio is still unknown be decided without ``/tokenize`` when
the decision does not depend on it (a short request far from every boundary): the estimate's interval assumes
a ratio within 15% of cl100k, which only exact counts can confirm (:mod:`agentkv.tokens.bound`); the ceiling
assumes only the framing. That assumption is checked too: every exact count of a backend is compared with its
payload's ceiling, and a backend whose template ever spends more is never decided on a ceiling again
(:meth:`~agentkv.tokens.bound.EstimateBound.check_ceiling`).

    byte_ceiling(Payload(({"role": "user", "content": "ping"},)))   # 76: 28 bytes + slacks
"""

from __future__ import annotations

from typing import Any, Mapping

from agentkv.events import canonical_json
from agentkv.tokens.payload import Payload
from agentkv.tokens.sources.estimate import FIXED_SLACK, PER_MESSAGE_SLACK

__all__ = ["TOOLS_PREAMBLE", "byte_ceiling"]

TOOLS_PREAMBLE = 512
"""Tokens a template may add around tool schemas (Hermes-style instructions are 100 to 300)."""
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})


def byte_ceiling(payload: Payload) -> int | None:
    """The most tokens ``payload`` can render to on any byte-covering tokenizer (see the module), or None when a
    message carries a non-text content part."""
    if payload.messages is None:
        return len((payload.prompt or "").encode()) + FIXED_SLACK
    if not all(_text_only(message) for message in payload.messages):
        return None
    size = len(canonical_json(list(payload.messages)).encode())
    tools = 0
    if payload.tools:
        tools = len(canonical_json([list(payload.tools), payload.tool_choice]).encode()) + TOOLS_PREAMBLE
    if payload.template_kwargs:
        size += len(canonical_json(payload.template_kwargs).encode())
    return size + tools + FIXED_SLACK + PER_MESSAGE_SLACK * len(payload.messages)


def _text_only(message: Mapping[str, Any]) -> bool:
    content = message.get("content") if isinstance(message, (dict, Mapping)) else None
    if content is None or type(content) is str:
        return True
    if not isinstance(content, list):
        return False
    return all(isinstance(part, (dict, Mapping)) and part.get("type", "text") in _TEXT_PARTS for part in content)
