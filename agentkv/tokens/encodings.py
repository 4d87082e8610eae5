"""Offline tiktoken encodings and the one way agentkv turns text into token ids with them.

Chat templates write control markers such as ``<|im_start|>`` as text; every agentkv tokenizer treats all
text as text (``disallowed_special=()``), so a count and the embedded engine always agree.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from agentkv._support.env import ensure_tiktoken_offline

DEFAULT_ENCODING = "cl100k_base"


@lru_cache(maxsize=8)
def get_encoding(name: str = DEFAULT_ENCODING) -> Any:
    """The tiktoken encoding ``name``, loaded from local files only."""
    ensure_tiktoken_offline()
    import tiktoken

    return tiktoken.get_encoding(name)


def encode(encoding: Any, text: str) -> list[int]:
    """Token ids of ``text``, special-token look-alikes encoded as plain text."""
    return list(encoding.encode_ordinary(text))  # = encode(text, disallowed_special=()), without its checks


def eos_token_id(encoding: Any) -> int:
    """The encoding's end-of-text id, used as EOS by the embedded engine."""
    return int(encoding.eot_token)
