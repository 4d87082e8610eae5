"""``agentkv report``'s picture of a conversation's life: tokens per turn against fast's window, where routing leaves
fast and the warm-ahead line; each turn's route, the warm, the escalation and the cached tokens (matplotlib, Agg).

What is drawn is bounded whatever the turns: at most :data:`COLUMNS` bars (past that, each bar is the tallest of its
run of turns, red if any of them went to slow), one label a turn only up to :data:`DETAIL` turns, and warm marks as
one series past :data:`MARKS` of them. 100,000 turns draw as fast as 600.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.report.ledger import ConversationLife

__all__ = ["COLUMNS", "DETAIL", "FORMATS", "MARKS", "Columns", "columns", "draw", "picture_format"]

COLUMNS = 600
DETAIL = 120  # up to this many turns: a tick and a route label a turn
MARKS = 20  # up to this many warm columns: a "warm fired" label each
FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp", "eps")  # what Agg and its siblings write
_COLOURS = {"fast": "#4C72B0", "slow": "#C44E52"}
_OTHER = "#8C8C8C"


@dataclass(frozen=True)
class Columns:
    """The bars drawn: each the tallest of ``per`` consecutive turns (x: the first turn's number)."""

    x: list[int]
    tokens: list[int]
    cached: list[int]
    colours: list[str]
    warm: list[bool]
    per: int


def columns(life: ConversationLife, most: int = COLUMNS) -> Columns:
    """``life``'s turns in at most ``most`` columns, in one pass (pure)."""
    per = max(1, -(-len(life.turns) // most))
    x, tokens, cached, colours, warm = [], [], [], [], []
    for start in range(0, len(life.turns), per):
        stop = start + per
        x.append(life.turns[start])
        tokens.append(max(life.input_tokens[start:stop]))
        cached.append(max(c or 0 for c in life.cached_tokens[start:stop]))
        colours.append(_colour(life.backends[start:stop]))
        warm.append("fire" in life.warms[start:stop])
    return Columns(x, tokens, cached, colours, warm, per)


def _colour(backends: list[str]) -> str:
    return _COLOURS["slow"] if "slow" in backends else _COLOURS["fast"] if "fast" in backends else _OTHER


def picture_format(path: str | Path) -> str:
    """The format ``path``'s extension names (one of :data:`FORMATS`); :class:`ValueError` for any other."""
    suffix = Path(path).suffix
    if suffix[1:].lower() not in FORMATS:
        raise ValueError(f"{suffix or 'no extension'} is not a picture agentkv report writes "
                         f"({', '.join('.' + f for f in FORMATS)})")
    return suffix[1:].lower()


def draw(life: ConversationLife, path: str | Path, *, title: str = "a conversation's life") -> Path:
    """Draw ``life`` to ``path`` (a .png, or another of :data:`FORMATS`, written exactly there); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(path)
    kind = picture_format(target)
    fig, axis = plt.subplots(figsize=(12, 5.5))
    try:
        _draw_on(axis, life, columns(life))
        axis.set_title(title)
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        fig.tight_layout()
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, format=kind)
    finally:
        plt.close(fig)
    return target


def _draw_on(axis: Any, life: ConversationLife, cols: Columns) -> None:
    from matplotlib.collections import PolyCollection

    runs = f" (the tallest of each {cols.per} turns)" if cols.per > 1 else ""
    axis.add_collection(PolyCollection(_boxes(cols, cols.tokens), facecolors=cols.colours,
                                       label=f"input tokens{runs} (blue: fast, red: slow)"))
    axis.add_collection(PolyCollection(_boxes(cols, cols.cached), facecolors="none", edgecolors="black", hatch="//",
                                       linewidths=1.0 if cols.per == 1 else 0.0, label="cached tokens"))
    axis.autoscale_view()
    _window_lines(axis, life)
    _warm_marks(axis, life, cols)
    _escalation(axis, life)
    if len(life.turns) <= DETAIL:
        for turn, reason in zip(life.turns, life.reasons):
            axis.annotate(reason, (turn, 0), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                          rotation=90, fontsize=7, color="white")
        axis.set_xticks(life.turns)
    axis.set_ylim(0, max([*cols.tokens, life.fast_window or 0, 1]) * 1.15)
    axis.set_xlabel("turn")
    axis.set_ylabel("tokens")


def _boxes(cols: Columns, heights: list[int]) -> list[list[tuple[float, float]]]:
    """One rectangle a column (one collection draws them all: a bar a turn was 1.5 ms of matplotlib each)."""
    width = 0.7 if cols.per == 1 else cols.per
    return [[(x - 0.35, 0), (x - 0.35, h), (x - 0.35 + width, h), (x - 0.35 + width, 0)]
            for x, h in zip(cols.x, heights)]


def _window_lines(axis: Any, life: ConversationLife) -> None:
    if life.fast_window is not None:
        axis.axhline(life.fast_window, color="red", linestyle="--", label=f"fast window ({life.fast_window})")
    if life.leave_fast_at is not None:
        axis.axhline(life.leave_fast_at, color="purple", linestyle="-.",
                     label=f"routing leaves fast ({life.leave_fast_at}: window less the output floor)")
    if life.warm_at is not None:
        axis.axhline(life.warm_at, color="orange", linestyle=":", label=f"warm-ahead ({life.warm_at})")


def _warm_marks(axis: Any, life: ConversationLife, cols: Columns) -> None:
    marks = [(x, height) for x, height, warm in zip(cols.x, cols.tokens, cols.warm) if warm]
    if len(marks) > MARKS:
        axis.scatter([x for x, _ in marks], [h for _, h in marks], marker="v", color="darkorange", zorder=3,
                     label=f"warm fired ({len(life.warm_turns)} turns)")
        return
    for x, height in marks:
        axis.annotate("warm fired", (x, height), xytext=(0, 6), textcoords="offset points", ha="center",
                      color="darkorange", fontweight="bold", arrowprops={"arrowstyle": "-", "color": "darkorange"})


def _escalation(axis: Any, life: ConversationLife) -> None:
    turn = life.escalation_turn
    if turn is not None:
        height = life.input_tokens[life.turns.index(turn)]
        axis.annotate("escalation", (turn, height), xytext=(0, 6), textcoords="offset points", ha="center",
                      color="#C44E52", fontweight="bold")
