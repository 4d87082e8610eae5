"""Rich tables for ``agentkv evaluate`` and ``agentkv bench handoff``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.table import Table


def _fmt(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def summary_table(manifest: Mapping[str, Any], verdict: str) -> Table:
    """Backend, models, hyper-parameters and the gate figures of a saved mapper."""
    evaluation = manifest.get("evaluation", {})
    signatures = manifest.get("signatures", {})
    table = Table(title="KV mapper", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    rows = [
        ("backend", manifest.get("backend")),
        ("source", signatures.get("source", {}).get("model_id")),
        ("target", signatures.get("target", {}).get("model_id")),
        ("k / lambda", f"{manifest.get('k', '-')} / {manifest.get('lam', '-')}"),
        ("calibration tokens", manifest.get("calibration_tokens")),
        ("parameters", manifest.get("parameters")),
        ("evaluated tokens", evaluation.get("tokens")),
        ("attention-output cosine", _fmt(evaluation.get("attention_cosine"))),
        ("greedy next-token agreement", _fmt(evaluation.get("greedy_agreement"))),
        ("mean KL(true || mapped)", _fmt(evaluation.get("mean_kl"), 6)),
        ("gate", verdict),
    ]
    for name, value in rows:
        table.add_row(name, _fmt(value))
    return table


def layer_table(manifest: Mapping[str, Any]) -> Table:
    """Per target layer: selected source layers, held-out R² (fit space), mapped R² and attention cosine."""
    evaluation = manifest.get("evaluation", {})
    heldout = manifest.get("calibration", {}).get("heldout_r2", {})
    table = Table(title="per target layer")
    for name in ("layer", "source layers", "fit R² K", "fit R² V", "R² K", "R² V", "attn cos"):
        table.add_column(name, justify="right")
    columns = [heldout.get("keys"), heldout.get("values"), evaluation.get("key_r2"), evaluation.get("value_r2"),
               evaluation.get("attention_cosine_per_layer")]
    for layer, chosen in enumerate(manifest.get("selected_layers", [])):
        cells = [_fmt(col[layer]) if col else "-" for col in columns]
        table.add_row(str(layer), ",".join(map(str, chosen)), *cells)
    return table


def bench_table(rows: Sequence[tuple[str, str, str, str]], title: str) -> Table:
    """Tokens, map ms, re-prefill ms and the ratio."""
    table = Table(title=title)
    for name in ("tokens", "map ms", "re-prefill ms", "prefill / map"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def print_tables(*tables: Table, console: Console | None = None) -> None:
    """Print tables to ``console`` (stdout by default)."""
    console = console or Console()
    for table in tables:
        console.print(table)
