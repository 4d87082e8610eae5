"""Escalation time to first token: cooldown-only warm-ahead, event-aware warm-ahead and cold, at a ~16K escalation.

The same scripted conversation runs three times on one pair of embedded servers (fast: small model,
16384-token window; slow: large model, 32768-token window, publishing vLLM's KV events): with the
cooldown-only warm-ahead, with event-aware warm-ahead (a CacheLedger following slow: skip a resident
prefix, re-warm an evicted one, top up past --top-up tokens), and cold (warm-ahead off, another tenant's
cache_salt). Each turn adds about 1K tokens of tool output (--rows); the user's think time between turns
(150 s) is told to the cooldown clock rather than slept, and any warm fired in a turn is allowed to finish
before the next turn, as it would during real think time.

The three runs go in lockstep (each turn is sent by the three Sessions one after another), so the escalated
turns are measured seconds apart. Printed side by side: escalated TTFT / fast TTFT on a same-size turn (the
last turn fast answered: it prefills the same ~1-turn tail on top of its own cache; the median of the three
runs' identical turn), escalated TTFT / cold, warms sent, and the tokens slow prefilled for them.

    python benchmarks/warm_ahead.py                   # embedded, then real vLLM when the tier's venv exists
    python benchmarks/warm_ahead.py --engine vllm     # real vLLM 0.32 CPU servers only (agentkv.vllm_launch)

On real vLLM the pair is the tier's checkpoints (agentkv.vllm_launch.models) at the same windows, slow publishing
KV events on bind endpoints; the embedded run takes about 6 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics

import structlog

from agentkv.demo.runs import DemoConfig, DemoRun, run_modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-window", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=15, help="tool-result rows per turn (~70 tokens each)")
    parser.add_argument("--top-up", type=int, default=1024, help="WarmAheadPolicy.top_up_tokens (event-aware run)")
    parser.add_argument("--turns", action="store_true", help="print every turn of every run")
    parser.add_argument("--tiny", action="store_true", help="tiny models on both sides (a smoke run, not the figure)")
    parser.add_argument("--engine", choices=("embedded", "vllm", "both"), default=None,
                        help="who serves (default: both when the real-vLLM tier's venv exists, else embedded)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    engines = _engines(args.engine)
    summary = []
    for engine in engines:
        config = DemoConfig(fast_window=args.fast_window, slow_window=2 * args.fast_window, result_rows=args.rows,
                            turns_after_escalation=0, max_turns=40, tool_latency_s=0.0, max_tokens=4,
                            warm_timeout_s=600.0, top_up_tokens=args.top_up, engine=engine,
                            **({"fast_size": "tiny", "slow_size": "tiny"} if args.tiny else {}))
        print(f"== {engine}: fast window {config.fast_window}, slow window {config.slow_window}")
        row = _report(engine, run_modes(config), args)
        if row:
            summary.append(row)
    if len(summary) > 1:
        print("\nside by side (escalated TTFT, ms):")
        print(f"{'engine':10s} {'tokens':>7s} {'cold':>8s} {'cooldown':>9s} {'event':>8s} {'event/cold':>11s}")
        for engine, tokens, cold_ms, plain_ms, aware_ms in summary:
            print(f"{engine:10s} {tokens:7d} {cold_ms:8.0f} {plain_ms:9.0f} {aware_ms:8.0f} {aware_ms / cold_ms:11.3f}")


def _engines(choice: str | None) -> tuple[str, ...]:
    if choice in ("embedded", "vllm"):
        return (choice,)
    if choice == "both":
        return ("embedded", "vllm")
    from agentkv.vllm_launch import venv_python

    return ("embedded", "vllm") if venv_python() is not None else ("embedded",)


def _report(engine: str, runs: tuple[DemoRun, DemoRun, DemoRun], args: argparse.Namespace) -> tuple | None:
    plain, aware, cold = runs
    if args.turns:
        for run in (plain, aware, cold):
            print(f"{run.label:11s}: " + "  ".join(
                f"t{r.turn}:{r.input_tokens}tok/{r.backend}/{r.warm or '-'}/{r.ttft_s:.2f}s/{r.cached_tokens}c"
                for r in run.rows))
    cool = cold.escalation()
    if cool is None or plain.escalation() is None or aware.escalation() is None:
        print("no escalation happened")
        return None
    fast = statistics.median(t.ttft_s for t in (run.last_fast_turn() for run in (plain, aware, cold)) if t)
    print(f"load average {os.getloadavg()[0]:.2f}; escalation at ~{cool.input_tokens} tokens; cold TTFT "
          f"{cool.ttft_s * 1000:.0f} ms; fast TTFT on the turn before {fast * 1000:.0f} ms; top_up_tokens {args.top_up}")
    print(f"{'mode':12s} {'esc TTFT':>9s} {'cached':>7s} {'esc/fast':>9s} {'esc/cold':>9s} {'warms':>6s} "
          f"{'warm prefill':>13s}  counters")
    for run in (plain, aware):
        print(_line(run, cool.ttft_s, fast))
    hot = aware.escalation()
    assert hot is not None
    ratio, same = hot.ttft_s / cool.ttft_s, hot.ttft_s / fast
    print(f"event-aware: escalated/cold = {ratio:.3f} (target <= 0.1: {'met' if ratio <= 0.1 else 'NOT met'}); "
          f"escalated/fast = {same:.2f} (target <= 1.5: {'met' if same <= 1.5 else 'NOT met'})")
    stats = aware.stats
    print(f"ledger predictions: {stats['ledger_predictions']} ({stats['ledger_predictions_exact']} exact), predicted "
          f"{stats['ledger_predicted_tokens']} vs reported {stats['ledger_reported_tokens']} cached tokens")
    plain_hot = plain.escalation()
    assert plain_hot is not None
    return engine, cool.input_tokens, cool.ttft_s * 1000, plain_hot.ttft_s * 1000, hot.ttft_s * 1000


def _line(run: DemoRun, cold_ttft_s: float, fast_ttft_s: float) -> str:
    hot = run.escalation()
    assert hot is not None
    same = hot.ttft_s / fast_ttft_s
    counters = ", ".join(f"{k.removeprefix('warm_')}={v}" for k, v in run.stats.items()
                         if k.startswith("warm_") and k not in ("warm_completed",) and v)
    return (f"{run.label:12s} {hot.ttft_s * 1000:7.0f}ms {hot.cached_tokens or 0:7d} {same:9.2f} "
            f"{hot.ttft_s / cold_ttft_s:9.3f} {run.warms_sent:6d} {run.slow_prefill_before_escalation:13d}  {counters}")


if __name__ == "__main__":
    main()
