"""A conversation's turn ledger as a JSON-lines file, and what a report draws from it (pure: no plotting here).

The file's first line describes the Session (``{"agentkv_ledger": 1, "fast_window": …, "output_floor": …,
"warm_threshold": …}``); each next line is one :class:`~agentkv.stats.LedgerEntry` as a JSON object. Sizes, routes
and cache figures only: no prompt text.

A JSON-lines event log (structlog's ``JSONRenderer``: one ``{"event": …}`` object a line) is read too: each answered
turn is a ``turn_answered`` event carrying its ledger row, and ``route`` events give fast's window and the output
floor; the log may hold many conversations (``session`` picks one; the longest by default).

    session.write_ledger("turns.jsonl")          # then: agentkv report turns.jsonl --out life.png
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

from agentkv.stats import LedgerEntry

__all__ = ["LEDGER_FORMAT", "ConversationLife", "life_of", "read_ledger", "write_ledger"]

LEDGER_FORMAT = 1
_MAX_LINE = 1 << 16  # a ledger line is a few hundred bytes: a longer one is not a ledger's
_MAX_ROWS = 100_000


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
    one with the most turns; ``warm_threshold`` is the line a log does not record); :class:`ValueError` naming the
    line when the file is neither."""
    header: dict[str, Any] | None = None
    rows: list[LedgerEntry] = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if len(line) > _MAX_LINE or len(rows) >= _MAX_ROWS:
                raise ValueError(f"{path}: line {number} is past what a ledger holds")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if header is None:  # no ledger's header: a log (whose other lines a renderer may have written)
                    return _from_events(path, session, warm_threshold)
                raise ValueError(f"{path}: line {number} is not JSON ({exc.msg})") from None
            if header is None:
                if isinstance(record, dict) and "event" in record:
                    return _from_events(path, session, warm_threshold)
                if not isinstance(record, dict) or record.get("agentkv_ledger") != LEDGER_FORMAT:
                    raise ValueError(f"{path}: not an agentkv ledger (Session.write_ledger writes one) nor a JSON-lines "
                                     "event log")
                header = record
                continue
            rows.append(_row(record, f"{path}: line {number}"))
    if header is None:
        raise ValueError(f"{path}: empty")
    return header, rows


_NAMES = frozenset(spec.name for spec in fields(LedgerEntry))


def _row(record: Any, where: str) -> LedgerEntry:
    if not isinstance(record, dict) or not {"turn", "input_tokens", "backend"} <= set(record):
        raise ValueError(f"{where} is not a ledger row")
    try:
        return LedgerEntry(**{k: v for k, v in record.items() if k in _NAMES})
    except TypeError as exc:
        raise ValueError(f"{where} is not a ledger row ({exc})") from None


def _from_events(path: str | Path, session: str | None, warm_threshold: float) -> tuple[dict[str, Any], list[LedgerEntry]]:
    """One conversation's ledger from a JSON-lines event log: its ``turn_answered`` rows, fast's window and the floor
    from its ``route`` events. Lines that are not JSON objects are skipped (a log may mix renderers)."""
    turns: dict[str, list[LedgerEntry]] = {}
    windows: dict[str, tuple[int | None, int | None]] = {}
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if len(line) > _MAX_LINE or sum(map(len, turns.values())) >= _MAX_ROWS:
                raise ValueError(f"{path}: line {number} is past what a ledger holds")
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            who = str(record.get("session"))
            if record.get("event") == "turn_answered":
                turns.setdefault(who, []).append(_row(record, f"{path}: line {number}"))
            elif record.get("event") == "route" and record.get("role") == "fast":
                windows[who] = (record.get("window"), record.get("floor"))
    if not turns:
        raise ValueError(f"{path}: not an agentkv ledger (Session.write_ledger writes one), nor a JSON-lines log with "
                         "turn_answered events (agentkv logs them at info level)")
    chosen = session if session is not None else max(turns, key=lambda who: len(turns[who]))
    if chosen not in turns:
        raise ValueError(f"{path}: no turns of session {chosen!r}; sessions: {sorted(turns)[:10]}")
    window, floor = windows.get(chosen, (None, None))
    header = {"agentkv_ledger": LEDGER_FORMAT, "fast_window": window, "output_floor": floor,
              "warm_threshold": warm_threshold, "session": chosen}
    return header, turns[chosen]


def life_of(header: dict[str, Any], rows: list[LedgerEntry]) -> ConversationLife:
    """The report's data from a ledger's header and rows."""
    window, floor, threshold = header.get("fast_window"), header.get("output_floor"), header.get("warm_threshold")
    return ConversationLife(
        turns=[r.turn for r in rows], input_tokens=[r.input_tokens for r in rows], backends=[r.backend for r in rows],
        reasons=[r.reason for r in rows], warms=[r.warm for r in rows], cached_tokens=[r.cached_tokens for r in rows],
        fast_window=window, leave_fast_at=window - floor if isinstance(window, int) and isinstance(floor, int) else None,
        warm_at=int(window * threshold) if isinstance(window, int) and isinstance(threshold, (int, float)) else None)
