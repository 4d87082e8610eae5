"""The report's input, line by line and bounded: each line is read in a bounded piece before it is decoded or parsed,
the lines and bytes of a file are bounded in total, and JSON is parsed strictly (no NaN or Infinity, no number of more
than 19 digits, no nesting past the parser's depth). What is refused names its file and line: ``FILE line N: why``.

Bounds: a line holds at most :data:`MAX_LINE` bytes, a file at most :data:`MAX_LINES` lines and :data:`MAX_BYTES`
bytes (a ledger line is a few hundred bytes; a log line of agentkv's events about a kilobyte).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any, Generator

__all__ = ["MAX_BYTES", "MAX_LINE", "MAX_LINES", "ReportError", "numbered_lines", "parse_json"]

MAX_LINE = 1 << 16  # bytes in a line, its newline aside
MAX_LINES = 1_000_000
MAX_BYTES = 1 << 29  # 512 MiB
_MAX_DIGITS = 19  # a number's digits: 2**63 has 19, a token count 10
_MAX_FLOAT_TEXT = 40


class ReportError(ValueError):
    """A file the report refuses: ``FILE line N: why`` (``FILE: why`` for the whole file)."""

    def __init__(self, path: str | Path, line: int | None, why: str) -> None:
        self.path, self.line, self.why = str(path), line, why
        super().__init__(f"{path} line {line}: {why}" if line is not None else f"{path}: {why}")


def numbered_lines(path: str | Path) -> Generator[tuple[int, str], None, None]:
    """Each line of ``path``, decoded and numbered from 1, read in pieces of at most :data:`MAX_LINE` bytes (so a
    one-line 400 MB file or ``/dev/zero`` is refused at its first piece); :class:`ReportError` past a bound or for a
    line that is not UTF-8."""
    total = 0
    with Path(path).open("rb") as source:
        for number in itertools.count(1):
            piece = source.readline(MAX_LINE + 2)
            if not piece:
                return
            if number > MAX_LINES:
                raise ReportError(path, number, f"past the {MAX_LINES:,} lines a report reads")
            total += len(piece)
            yield number, _decoded(path, number, piece, total)


def _decoded(path: str | Path, number: int, piece: bytes, total: int) -> str:
    if len(piece.rstrip(b"\r\n")) > MAX_LINE:
        raise ReportError(path, number, f"longer than the {MAX_LINE:,} bytes a line may hold")
    if total > MAX_BYTES:
        raise ReportError(path, number, f"past the {MAX_BYTES >> 20} MiB a report reads")
    try:
        return piece.decode("utf-8-sig" if number == 1 else "utf-8")  # an editor's byte-order mark, if any
    except UnicodeDecodeError:
        raise ReportError(path, number, "not UTF-8 text") from None


class _Refused(ValueError):
    """A JSON value the report does not read (raised from inside the parser's hooks)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise _Refused(f"a number of {len(text.lstrip('-'))} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text) if len(text) <= _MAX_FLOAT_TEXT else math.inf
    if not math.isfinite(value):
        raise _Refused(f"a number past a float's range ({text[:20]})")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"{name}, which is not a number JSON holds")


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant)


def parse_json(line: str) -> Any:
    """``line``'s JSON value, parsed strictly; :class:`ValueError` saying why it is refused."""
    try:
        return _DECODER.decode(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}, column {exc.colno})") from None
    except _Refused as exc:
        raise ValueError(f"not JSON a report reads: {exc}") from None
    except RecursionError:
        raise ValueError("not JSON a report reads: nested too deep") from None
