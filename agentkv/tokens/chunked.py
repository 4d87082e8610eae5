"""Counting text by newline-bounded chunks, each tokenized once: a long conversation's next turn costs only
the chunks it added.

:class:`ChunkedEncoder` memoises chunk counts; :func:`split_lines` cuts a text into its chunks and
:func:`word_cut` a new line after its first word. Which tokenizers count a text exactly as the sum of such
pieces is known, not sampled (:mod:`agentkv.tokens.cuts`).

    encoder = ChunkedEncoder(encoding.encode_ordinary, cuts="words")
    encoder.count(rendered_conversation)
"""

from __future__ import annotations

import re
import sys
from typing import Callable, Sequence

from agentkv.events import emit
from agentkv.tokens.cuts import Cuts

__all__ = ["ChunkedEncoder", "split_lines", "word_cut"]

# A point right after a newline and before a non-space character is a pre-token boundary for the
# cl100k-style splitting regexes (cl100k, o200k, Llama-3, Qwen2): no pre-token runs across it, so token
# counts of the pieces add up exactly. Which tokenizers split there is known, not sampled (tokens/cuts.py).
# Not before a "/": o200k's punctuation pre-token runs on through newlines and slashes (",\n//" is one).
_CHUNK_BOUNDARY = re.compile(r"(?<=\n)(?=[ \t]*\S)(?!/)")
# A newline that is not a chunk boundary: only spaces or tabs, then another whitespace character or the end,
# or a "/" right after it (possessive where the re module has it: the same matches, found without
# backtracking). _GLUED_AT finds each one (a lookahead: "\n\n\n" has two).
_GLUED_NEWLINE = re.compile(r"\n(?:[ \t]*+(?:[^\S \t]|\Z)|/)" if sys.version_info >= (3, 11)
                            else r"\n(?:[ \t]*(?:[^\S \t]|\Z)|/)")
_GLUED_AT = re.compile(r"\n(?=[ \t]*(?:[^\S \t]|\Z)|/)")


def split_lines(text: str) -> tuple[list[str], list[str]]:
    """``text``'s chunks (:data:`_CHUNK_BOUNDARY`), in two lists: ``lines``, chunks that are one line and its
    newline (given without it), and ``rest``, the others (lines joined by blank ones, a last line without a
    newline). Their order is lost; their counts add up to the text's.

    Cutting with ``str.split`` is several times faster than the look-around split; the chunks are the same."""
    ends = text.endswith("\n")
    body = text[:-1] if ends else text
    lines = body.split("\n")
    last = len(lines) - 1  # lines[last] is followed by the text's end, or by its final newline (when ends)
    glued = _glued_lines(body) if _GLUED_NEWLINE.search(body) is not None else []
    rest = []
    for start, stop in reversed(glued):  # lines[start:stop] are one chunk
        rest.append("\n".join(lines[start:stop]) + ("\n" if stop <= last or ends else ""))
        del lines[start:stop]
    if not ends and (not glued or glued[-1][1] <= last):
        tail = lines.pop()
        if tail or not text:
            rest.append(tail)
    return lines, rest


def _glued_lines(body: str) -> list[tuple[int, int]]:
    """``(start, stop)`` for each run of lines that glued newlines join (newline k joins lines k and k + 1)."""
    runs: list[tuple[int, int]] = []
    index, at = 0, 0
    for match in _GLUED_AT.finditer(body):
        index += body.count("\n", at, match.start())
        at = match.start()
        if runs and runs[-1][1] == index + 1:
            runs[-1] = (runs[-1][0], index + 2)
        else:
            runs.append((index, index + 2))
    return runs


def word_cut(line: str) -> int:
    """Where ``line`` splits into two pre-token-bounded pieces: before its first space that follows a
    non-space and precedes one (``  "id":| "inc-7",``); 0 when it has none. The cl100k-style splitting
    regexes only ever start a pre-token with a space, so counts of the two pieces add up
    (:mod:`agentkv.tokens.cuts` says for which tokenizers)."""
    i = line.find(" ", 1)
    while i > 0:
        if not line[i - 1].isspace() and i + 1 < len(line) and not line[i + 1].isspace():
            return i
        i = line.find(" ", i + 1)
    return 0


class ChunkedEncoder:
    """Counts text by newline-bounded chunks, each tokenized once and memoised by its content.

    Appending one message to a long conversation tokenizes only that message's chunks, and of a line
    not seen before, only what follows its first word when that word was seen (:func:`word_cut`: a
    JSON line's key repeats, its value is new). ``encode`` is ``text -> token ids``; ``cuts`` says
    where this tokenizer is known to count exactly (:func:`~agentkv.tokens.cuts.tokenizer_cuts`:
    ``"words"``, ``"lines"``, or ``"whole"``, the default, for a tokenizer nothing is known about:
    whole texts are counted). As a guard, the first call also checks the cuts on its text and counts
    whole texts (or lines without word cuts) from then on where they do not add up.
    """

    def __init__(self, encode_fn: Callable[[str], Sequence[int]], maxsize: int = 65536, *,
                 cuts: Cuts = "whole") -> None:
        self._encode = encode_fn
        self._cuts = cuts
        # plain dicts (atomic get/set), each emptied when it outgrows maxsize: chunks and line pieces, and
        # lines (a line's count is that of the line and its newline)
        self._memo: dict[str, int] = {}
        self._lines: dict[str, int] = {}
        self._maxsize = maxsize
        self._chunking: bool | None = None
        self._word_cuts = False

    @property
    def splits_exactly(self) -> bool:
        """True once the first count confirmed the declared cuts (never for ``cuts="whole"``)."""
        return bool(self._chunking)

    def count(self, text: str) -> int:
        if self._chunking is None:
            self._chunking, self._word_cuts = self._cuts_hold(text)
        if not self._chunking:
            return len(self._encode(text))
        lines, rest = split_lines(text)
        total = self._sum(self._lines, lines, self._line_count)
        return total + (self._sum(self._memo, rest, self._piece_count) if rest else 0)

    def _sum(self, memo: dict[str, int], keys: list[str], count: Callable[[str], int]) -> int:
        """The summed counts of ``keys``: memo lookups at C speed, each miss counted once by ``count``."""
        counts = list(map(memo.get, keys))
        if None in counts:
            for i, key in enumerate(keys):
                if counts[i] is None:
                    counted = memo.get(key)  # a chunk repeated within this text is counted once
                    counts[i] = memo[key] = count(key) if counted is None else counted
            if len(memo) > self._maxsize:
                memo.clear()
        return sum(counts)  # type: ignore[arg-type]

    def _line_count(self, line: str) -> int:
        """Tokens of ``line`` and its newline: its first word and the rest apart when they split exactly."""
        cut = word_cut(line) if self._word_cuts else 0
        if cut == 0:
            return len(self._encode(line + "\n"))
        memo, head = self._memo, line[:cut]
        counted = memo.get(head)
        if counted is None:
            counted = memo[head] = len(self._encode(head))
        return counted + len(self._encode(line[cut:] + "\n"))

    def _piece_count(self, piece: str) -> int:
        return len(self._encode(piece))

    def _cuts_hold(self, text: str) -> tuple[bool, bool]:
        """Whether the declared cuts (chunks; word cuts within lines) count as the whole text does, checked on
        ``text``: a guard, the declaration decides (a tokenizer whose cuts are unknown is never cut)."""
        if self._cuts == "whole":
            return False, False
        sample = text if len(text) < 200_000 else text[:200_000]
        whole = len(self._encode(sample))
        chunks = _CHUNK_BOUNDARY.split(sample)
        pieces = sum(len(self._encode(c)) for c in chunks)
        if whole != pieces:
            emit("chunked_count_disabled", level="warning", whole=whole, chunked=pieces)
            return False, False
        if self._cuts != "words":
            return True, False
        words = sum(len(self._encode(p)) for c in chunks for p in _word_pieces(c))
        if words != whole:
            emit("word_cuts_disabled", level="warning", whole=whole, chunked=words)
        return True, words == whole


def _word_pieces(chunk: str) -> tuple[str, ...]:
    cut = word_cut(chunk)
    return (chunk[:cut], chunk[cut:]) if cut else (chunk,)
