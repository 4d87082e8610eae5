"""Where a tokenizer's counts add up: the cuts its pre-tokenizer is known never to cross.

:class:`~agentkv.tokens.ChunkedEncoder` counts a text as the sum of its pieces' counts. That is exact only
where no pre-token spans a cut and each piece splits as it does inside the text. Two cuts are used:

- ``"lines"``: right after a newline, before optional spaces or tabs and a non-space character;
- ``"words"``: those, and within a line, before a single space between two non-space characters
  (:func:`~agentkv.tokens.chunked.word_cut`).

``"whole"`` means neither is known: whole texts are counted. The rule is read from what the tokenizer
declares (a tiktoken encoding's name, a ``tokenizers`` pipeline's configuration), never inferred from
sample texts: a first text that happens to add up says nothing about the next one.

    tokenizer_cuts("cl100k_base")   # "words"
    tokenizer_cuts(hf_tokenizer)    # "words" for Llama-3 or Qwen2, "whole" for a SentencePiece (Metaspace) one
"""

from __future__ import annotations

import json
from typing import Any, Literal, Mapping

__all__ = ["Cuts", "config_cuts", "tokenizer_cuts"]

Cuts = Literal["words", "lines", "whole"]

# cl100k and o200k: a pre-token holds whitespace only at its start (or is all whitespace), and a newline
# ends its own pre-token before the next line's indentation. GPT-2's regex (p50k, r50k) glues a newline to
# the next line's indentation ("\n   " + " return") and a trailing run of newlines to itself ("\n\n" at the
# end of a piece, "\n" + "\n" inside a text): neither cut is safe there.
TIKTOKEN_CUTS: dict[str, Cuts] = {"cl100k_base": "words", "o200k_base": "words", "o200k_harmony": "words",
                                  "p50k_base": "whole", "r50k_base": "whole"}

# ``tokenizers`` Split patterns of the cl100k family, as their tokenizer.json files spell them: Llama-3
# (cl100k's own), Qwen2 (single digits), Qwen3.5 (marks with letters), o200k; and tiktoken's current
# cl100k spelling. tests/test_count_cuts.py checks each on random text.
KNOWN_SPLIT_PATTERNS: dict[str, str] = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "qwen3.5": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "o200k": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "cl100k": r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$"
              r"|\s*[\r\n]|\s+(?!\S)|\s",
}
# Pre-tokenizers that split at every whitespace character and keep none inside a pre-token (WordPiece/BERT).
WHITESPACE_SPLITTERS = frozenset({"BertPreTokenizer", "Whitespace", "WhitespaceSplit"})
# What may follow the first splitter in a Sequence: each works on one piece at a time, whatever its position.
PER_PIECE = frozenset({"ByteLevel", "Digits", "Punctuation", "Split", *WHITESPACE_SPLITTERS})
# Normalizers that change characters one at a time (NFC composes marks onto the character before them: never
# across a space or a newline). After a regex splitter only NFC (Qwen2) and none (Llama-3) are accepted.
CHARACTERWISE = frozenset({"NFC", "NFD", "Lowercase", "StripAccents", "BertNormalizer"})


def tokenizer_cuts(tokenizer: Any) -> Cuts:
    """The cuts ``tokenizer`` (a tiktoken encoding name, a transformers fast tokenizer or a ``tokenizers``
    Tokenizer) is known to count across exactly; ``"whole"`` for anything else."""
    if isinstance(tokenizer, str):
        return TIKTOKEN_CUTS.get(tokenizer, "whole")
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    try:
        config = json.loads(backend.to_str())
    except Exception:  # a slow (Python) tokenizer, or anything without a tokenizers pipeline
        return "whole"
    return config_cuts(config) if isinstance(config, Mapping) else "whole"


def config_cuts(config: Mapping[str, Any]) -> Cuts:
    """The cuts a ``tokenizer.json`` configuration is known to count across exactly (pure)."""
    if not all(_inert(token) for token in config.get("added_tokens") or ()):
        return "whole"
    pre = config.get("pre_tokenizer")
    listed: list[Any] = list((pre.get("pretokenizers") or ()) if isinstance(pre, Mapping)
                             and pre.get("type") == "Sequence" else [pre])
    steps: list[Mapping[str, Any]] = [step for step in listed if isinstance(step, Mapping)]
    if not steps or len(steps) != len(listed):
        return "whole"
    first, rest = steps[0], steps[1:]
    if not all(_per_piece(step) for step in rest):
        return "whole"
    normalizers = _normalizers(config.get("normalizer"))
    if normalizers is None:
        return "whole"
    if first.get("type") in WHITESPACE_SPLITTERS:
        return "words" if normalizers <= CHARACTERWISE else "whole"
    if _known_split(first):
        return "words" if normalizers <= {"NFC"} else "whole"
    return "whole"


def _inert(token: Any) -> bool:
    """An added token that no cut can fall inside and that takes no whitespace from its neighbours."""
    content = token.get("content") if isinstance(token, Mapping) else None
    return (isinstance(content, str) and not any(c.isspace() for c in content)
            and not token.get("lstrip") and not token.get("rstrip"))


def _known_split(step: Mapping[str, Any]) -> bool:
    pattern = step.get("pattern")
    return (step.get("type") == "Split" and isinstance(pattern, Mapping)
            and pattern.get("Regex") in KNOWN_SPLIT_PATTERNS.values() and step.get("behavior") == "Isolated"
            and not step.get("invert"))


def _per_piece(step: Mapping[str, Any]) -> bool:
    kind = step.get("type")
    if kind == "ByteLevel":
        return not step.get("add_prefix_space")
    return kind in PER_PIECE


def _normalizers(normalizer: Any) -> set[str] | None:
    """The types of a normalizer pipeline, or None when it is not a list of plain steps."""
    if normalizer is None:
        return set()
    if not isinstance(normalizer, Mapping):
        return None
    if normalizer.get("type") != "Sequence":
        return {str(normalizer.get("type"))}
    kinds: set[str] = set()
    for step in normalizer.get("normalizers") or ():
        inner = _normalizers(step)
        if inner is None:
            return None
        kinds |= inner
    return kinds
