"""``agentkv report``'s picture of a conversation's life: tokens per turn against fast's window, where routing leaves
fast and the warm-ahead line; each turn's route, the warm, the escalation and the cached tokens (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from agentkv.report.ledger import ConversationLife

__all__ = ["draw"]

_COLOURS = {"fast": "#4C72B0", "slow": "#C44E52"}


def draw(life: ConversationLife, path: str | Path, *, title: str = "a conversation's life") -> Path:
    """Draw ``life`` to ``path`` (a PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(12, 5.5))
    colours = [_COLOURS.get(backend, "#8C8C8C") for backend in life.backends]
    axis.bar(life.turns, life.input_tokens, color=colours, width=0.7, label="input tokens (blue: fast, red: slow)")
    cached = [c or 0 for c in life.cached_tokens]
    axis.bar(life.turns, cached, color="none", edgecolor="black", hatch="//", width=0.7, label="cached tokens")
    if life.fast_window is not None:
        axis.axhline(life.fast_window, color="red", linestyle="--", label=f"fast window ({life.fast_window})")
    if life.leave_fast_at is not None:
        axis.axhline(life.leave_fast_at, color="purple", linestyle="-.",
                     label=f"routing leaves fast ({life.leave_fast_at}: window less the output floor)")
    if life.warm_at is not None:
        axis.axhline(life.warm_at, color="orange", linestyle=":", label=f"warm-ahead ({life.warm_at})")
    top = max([*life.input_tokens, life.fast_window or 0]) or 1
    height = dict(zip(life.turns, life.input_tokens))
    for turn in life.warm_turns:
        axis.annotate("warm fired", (turn, height[turn]), xytext=(0, 6), textcoords="offset points", ha="center",
                      color="darkorange", fontweight="bold", arrowprops={"arrowstyle": "-", "color": "darkorange"})
    if life.escalation_turn is not None:
        axis.annotate("escalation", (life.escalation_turn, height[life.escalation_turn]), xytext=(0, 6),
                      textcoords="offset points", ha="center", color="#C44E52", fontweight="bold")
    for turn, reason in zip(life.turns, life.reasons):
        axis.annotate(reason, (turn, 0), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                      rotation=90, fontsize=7, color="white")
    axis.set_ylim(0, top * 1.15)
    axis.set_xlabel("turn")
    axis.set_ylabel("tokens")
    axis.set_xticks(life.turns)
    axis.set_title(title)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    plt.close(fig)
    return target
