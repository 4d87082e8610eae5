"""A conversation's turn ledger as a JSON-lines file, and what a report draws from it (pure: no plotting here).

The file's first line describes the Session (``{"agentkv_ledger": 1, "fast_window": …, "output_floor": …,
"warm_threshold": …}``); each next line is one :class:`~agentkv.stats.LedgerEntry` as a JSON object. Sizes, routes
and cache figures only: no prompt text.

A JSON-lines event log (structlog's ``JSONRenderer``: one ``{"event": …}`` object a line) is read too: each answered
turn is a ``turn_answered`` event carrying its ledger row, and ``route`` events give fast's window and the output
floor; the log may hold many conversations (``session`` picks one; the longest by default).

Both are read in one pass, bounded (:mod:`agentkv.report.lines`: per line and in total; at most 100,000 rows and
100,000 conversations), every field checked: whatever is refused names its file and line (:class:`ReportError`).

    session.write_ledger("turns.jsonl")          # then: agentkv report turns.jsonl --out life.png
"""

from __future__ import annotations

import itertools
import json
from contextlib import closing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

from agentkv.report.lines import ReportError, numbered_lines, parse_json
from agentkv.stats import LedgerEntry

__all__ = ["LEDGER_FORMAT", "ConversationLife", "ReportError", "life_of", "read_ledger", "write_ledger"]

LEDGER_FORMAT = 1


@dataclass(frozen=True)
class ConversationLife:
    """What the report draws: per turn its tokens, route, reason, warm-ahead outcome and cached tokens, and the lines
    that explain the route (fast's window, where routing leaves fast, the warm-ahead threshold)."""

    turns: list[int]
    input_tokens: list[int]
    backends: list[str]
    reasons: list[str]
    warms: list[str]
    cached_tokens: list[int | None]
    fast_window: int | None
    leave_fast_at: int | None  # fast's window less the output floor: above it, a turn goes to slow
    warm_at: int | None  # the warm-ahead threshold in tokens

    @property
    def warm_turns(self) -> list[int]:
        return [t for t, w in zip(self.turns, self.warms) if w == "fire"]

    @property
    def escalation_turn(self) -> int | None:
        """The first turn answered by slow after one answered by fast (or the first slow one)."""
        previous = None
        for turn, backend in zip(self.turns, self.backends):
            if backend == "slow" and previous != "slow":
                return turn
            previous = backend
        return None


def write_ledger(path: str | Path, rows: Iterable[LedgerEntry], *, fast_window: int | None, output_floor: int,
                 warm_threshold: float | None) -> Path:
    """Write ``rows`` (and the Session's lines) to ``path`` as JSON lines; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    header = {"agentkv_ledger": LEDGER_FORMAT, "fast_window": fast_window, "output_floor": output_floor,
              "warm_threshold": warm_threshold}
    with target.open("w", encoding="utf-8") as out:
        out.write(json.dumps(header) + "\n")
        for row in rows:
            out.write(json.dumps(asdict(row)) + "\n")
    return target


def read_ledger(path: str | Path, *, session: str | None = None,
                warm_threshold: float = 0.6) -> tuple[dict[str, Any], list[LedgerEntry]]:
    """The header and rows of a ledger file, or of one conversation in a JSON-lines event log (``session``, else the
    one with the most turns; ``warm_threshold`` is the line a log does not record), read in one bounded pass;
    :class:`~agentkv.report.lines.ReportError` (a :class:`ValueError`) naming the line when the file is neither."""
    _checked({"warm_threshold": warm_threshold}, {"warm_threshold": _HEADER["warm_threshold"]})  # not NaN, not past 1
    with closing(numbered_lines(path)) as lines:
        for number, line in lines:
            if not line.strip():
                continue
            header = _header(path, number, line)
            if header is None:  # no ledger's header: a log (whose other lines a renderer may have written)
                return _from_events(path, itertools.chain([(number, line)], lines), session, warm_threshold)
            return header, _rows(path, lines)
    raise ReportError(path, None, "empty")


_MOST = 2**31  # a token count or turn number past it is no Session's
_MAX_TEXT = 256
_MAX_ROWS = 100_000
_MAX_SESSIONS = 100_000
_NOT_LEDGER = "not an agentkv ledger (Session.write_ledger writes one)"


@dataclass(frozen=True)
class _Kind:
    """What a field holds: one of ``types``, from ``least`` to ``most`` (a string's length); ``words`` says it in a
    refusal."""

    words: str
    types: tuple[type, ...]
    most: float
    least: float = 0
    optional: bool = False  # null (or absent) is allowed


_COUNT = _Kind("a whole number from 0 to 2**31", (int,), _MOST)
_SOME_COUNT = replace(_COUNT, optional=True)
_TEXT = _Kind(f"a string of at most {_MAX_TEXT} characters", (str,), _MAX_TEXT)
_KINDS: dict[str, _Kind] = {
    "turn": _COUNT, "input_tokens": _COUNT, "tool_tokens": _COUNT,
    "tools_share": _Kind("a number from 0 to 2**31", (int, float), _MOST), "count_source": _TEXT,
    "exact": _Kind("true or false", (bool,), 1), "backend": _TEXT, "reason": _TEXT, "warm": _TEXT,
    "cached_tokens": _SOME_COUNT,
}
_ROW = {spec.name: _KINDS[spec.name] for spec in fields(LedgerEntry)}  # in the row's order
_HEADER = {"agentkv_ledger": _Kind(f"{LEDGER_FORMAT}, the format this reader knows", (int,), LEDGER_FORMAT,
                                   least=LEDGER_FORMAT),
           "fast_window": _SOME_COUNT, "output_floor": _SOME_COUNT,
           "warm_threshold": _Kind("a number from 0 to 1", (int, float), 1, optional=True)}
_ROUTE = {"window": _SOME_COUNT, "floor": _SOME_COUNT}
_SESSION = {"session": replace(_TEXT, words=f"a conversation id ({_TEXT.words})", optional=True)}
_REQUIRED = tuple(spec.name for spec in fields(LedgerEntry) if spec.default is MISSING)
_WORDS: dict[type, str] = {str: "a string", list: "an array", dict: "an object"}


def _checked(record: dict[str, Any], kinds: dict[str, _Kind]) -> None:
    """:class:`ValueError` naming the first field of ``record`` that is not the kind ``kinds`` says."""
    for name, kind in kinds.items():
        value: Any = record.get(name)
        of = type(value)
        if of in kind.types and kind.least <= (len(value) if of is str else value) <= kind.most:
            continue
        if not (value is None and kind.optional):
            raise ValueError(f"{name} is {_shown(value)}, not {kind.words}")


def _shown(value: Any) -> str:
    text = _WORDS.get(type(value)) or json.dumps(value)
    return text if len(text) <= 40 else f"{text[:20]}… ({len(text)} characters)"


def _header(path: str | Path, number: int, line: str) -> dict[str, Any] | None:
    """The ledger's header on ``line``; None when the line starts an event log instead."""
    try:
        record = parse_json(line)
    except ValueError as exc:
        if '"agentkv_ledger"' not in line:
            return None
        raise ReportError(path, number, str(exc)) from None
    if isinstance(record, dict) and "event" in record and "agentkv_ledger" not in record:
        return None
    if not isinstance(record, dict) or "agentkv_ledger" not in record:
        raise ReportError(path, number, f"{_NOT_LEDGER} nor a JSON-lines event log")
    try:
        _checked(record, _HEADER)
    except ValueError as exc:
        raise ReportError(path, number, f"not a ledger's header: {exc}") from None
    return record


def _rows(path: str | Path, lines: Iterable[tuple[int, str]]) -> list[LedgerEntry]:
    rows: list[LedgerEntry] = []
    texts: dict[str, str] = {}
    for number, line in lines:
        if not line.strip():
            continue
        if len(rows) >= _MAX_ROWS:
            raise ReportError(path, number, f"past the {_MAX_ROWS:,} rows a report draws")
        try:
            rows.append(_row(parse_json(line), texts))
        except ValueError as exc:
            raise ReportError(path, number, str(exc)) from None
    return rows


def _row(record: Any, texts: dict[str, str]) -> LedgerEntry:
    """``record`` as a ledger row, its fields checked (``texts`` shares equal strings between rows);
    :class:`ValueError` saying why it is not one."""
    if not isinstance(record, dict):
        raise ValueError(f"not a ledger row: {_shown(record)}, not an object")
    missing = [name for name in _REQUIRED if name not in record]
    if missing:
        raise ValueError(f"not a ledger row: no {', '.join(missing)}")
    try:
        _checked(record, _ROW)
    except ValueError as exc:
        raise ValueError(f"not a ledger row: {exc}") from None
    values: list[Any] = [texts.setdefault(v, v) if type(v) is str else v for v in map(record.get, _ROW)]
    return LedgerEntry(*values)


@dataclass
class _Log:
    """One pass over an event log: each session's rows and fast's window and floor."""

    turns: dict[str, list[LedgerEntry]] = field(default_factory=dict)
    windows: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    rows: int = 0

    def take(self, record: dict[str, Any]) -> None:
        """Add ``record`` if it is a turn_answered or fast route event; :class:`ValueError` if it is a malformed one."""
        kind = record.get("event")
        is_route = kind == "route" and record.get("role") == "fast"
        if kind != "turn_answered" and not is_route:
            return
        _checked(record, _SESSION)
        who = str(record.get("session"))
        if who not in self.turns and who not in self.windows and len(self.windows) + len(self.turns) >= _MAX_SESSIONS:
            raise ValueError(f"past the {_MAX_SESSIONS:,} conversations a report reads")
        if is_route:
            _checked(record, _ROUTE)
            self.windows[who] = (record.get("window"), record.get("floor"))
        elif self.rows >= _MAX_ROWS:
            raise ValueError(f"past the {_MAX_ROWS:,} rows a report draws")
        else:
            self.turns.setdefault(who, []).append(_row(record, self.texts))
            self.rows += 1


def _from_events(path: str | Path, lines: Iterable[tuple[int, str]], session: str | None,
                 warm_threshold: float) -> tuple[dict[str, Any], list[LedgerEntry]]:
    """One conversation's ledger from a JSON-lines event log, grouped by session in one pass: its ``turn_answered``
    rows, fast's window and the floor from its ``route`` events. Lines that are not JSON objects are skipped (a log
    may mix renderers), unless they hold a ``turn_answered`` event."""
    log = _Log()
    for number, line in lines:
        try:
            record = parse_json(line) if line.strip() else None
        except ValueError as exc:
            if '"turn_answered"' not in line:
                continue
            raise ReportError(path, number, str(exc)) from None
        try:
            if isinstance(record, dict):
                log.take(record)
        except ValueError as exc:
            raise ReportError(path, number, str(exc)) from None
    if not log.turns:
        raise ReportError(path, None, f"{_NOT_LEDGER}, nor a JSON-lines log with turn_answered events (agentkv logs "
                          "them at info level)")
    chosen = session if session is not None else max(log.turns, key=lambda who: len(log.turns[who]))
    if chosen not in log.turns:
        raise ReportError(path, None, f"no turns of session {chosen!r}; sessions: {sorted(log.turns)[:10]}")
    window, floor = log.windows.get(chosen, (None, None))
    header = {"agentkv_ledger": LEDGER_FORMAT, "fast_window": window, "output_floor": floor,
              "warm_threshold": warm_threshold, "session": chosen}
    return header, log.turns[chosen]


def life_of(header: dict[str, Any], rows: list[LedgerEntry]) -> ConversationLife:
    """The report's data from a ledger's header and rows."""
    window, floor, threshold = header.get("fast_window"), header.get("output_floor"), header.get("warm_threshold")
    return ConversationLife(
        turns=[r.turn for r in rows], input_tokens=[r.input_tokens for r in rows], backends=[r.backend for r in rows],
        reasons=[r.reason for r in rows], warms=[r.warm for r in rows], cached_tokens=[r.cached_tokens for r in rows],
        fast_window=window, leave_fast_at=window - floor if isinstance(window, int) and isinstance(floor, int) else None,
        warm_at=int(window * threshold) if isinstance(window, int) and isinstance(threshold, (int, float)) else None)
