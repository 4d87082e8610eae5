"""The demo's per-turn table, headline and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentkv.demo.runs import DemoConfig, DemoRun


_WARM_LABELS = {"fire": "[green]fired[/green]", "cooldown": "cooldown", "disabled": "off", "below_threshold": "<60%",
                "routed_slow": "n/a", "unknown_model": "unknown", "saturated": "saturated"}


def table(run: DemoRun, config: DemoConfig) -> Any:
    """A rich table, one row per turn."""
    from rich.table import Table

    out = Table(title=f"{run.label} run — fast window {config.fast_window}, warm-ahead at 60%")
    for column in ("turn", "in tok", "tools", "fast win", "route", "warm", "TTFT ms", "cached"):
        out.add_column(column, justify="left" if column in ("route", "warm") else "right", no_wrap=True)
    for row in run.rows:
        warm = _WARM_LABELS.get(row.warm, row.warm or "-")
        out.add_row(
            str(row.turn), str(row.input_tokens), f"{row.tools_share:.0%}", f"{row.window_share:.0%}",
            f"{row.backend}/{row.reason}", warm, f"{row.ttft_s * 1000:.0f}",
            "-" if row.cached_tokens is None else str(row.cached_tokens),
        )
    return out


def headline(warm: DemoRun, cold: DemoRun) -> str:
    """The escalated turn's time to first token, warm against cold."""
    hot, cool = warm.escalation(), cold.escalation()
    if hot is None or cool is None:
        return "no escalation happened: raise --turns or lower the fast window"
    ratio = hot.ttft_s / cool.ttft_s if cool.ttft_s else float("nan")
    return (f"[bold]escalation at turn {hot.turn} ({hot.input_tokens} tokens):[/bold] TTFT {hot.ttft_s * 1000:.0f} ms "
            f"with warm-ahead ({hot.cached_tokens} cached) vs {cool.ttft_s * 1000:.0f} ms cold "
            f"({cool.cached_tokens} cached) — {ratio:.2f}x the cold time, {1 / ratio:.1f}x faster"
            f"; warm_fired={warm.stats.get('warm_fired')}, escalations_after_warm={warm.stats.get('escalations_after_warm')}")


def plot(warm: DemoRun, cold: DemoRun, config: DemoConfig, path: Path) -> Path:
    """Tokens per turn with the 60% line, the line where routing leaves fast (its window less the output floor the
    route keeps free) and the window, and time-to-first-token bars for both runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r.turn for r in warm.rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.plot(turns, [r.input_tokens for r in warm.rows], marker="o", label="input tokens")
    top.axhline(0.6 * config.fast_window, color="orange", linestyle="--", label="60% of fast window (warm-ahead)")
    from agentkv import RoutePolicy

    leaves = config.fast_window - RoutePolicy().output_floor
    top.axhline(leaves, color="purple", linestyle="-.", label=f"routing leaves fast ({config.fast_window} window − "
                f"{RoutePolicy().output_floor} output floor)")
    top.axhline(config.fast_window, color="red", linestyle="--", label="fast window")
    top.set_ylabel("tokens")
    top.legend(loc="upper left")
    width = 0.4
    bottom.bar([t - width / 2 for t in turns], [r.ttft_s * 1000 for r in warm.rows], width, label="warm-ahead")
    bottom.bar([r.turn + width / 2 for r in cold.rows], [r.ttft_s * 1000 for r in cold.rows], width, label="cold")
    bottom.set_ylabel("time to first token (ms)")
    bottom.set_xlabel("turn")
    bottom.legend(loc="upper left")
    fig.suptitle("agentkv demo (random-weight models: timings and cache hits are real, text is not)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
