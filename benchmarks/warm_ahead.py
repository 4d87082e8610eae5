"""Escalation time to first token with warm-ahead against cold, at a ~16K-token escalation.

The same scripted conversation runs twice on the embedded servers (fast: small model, 16384-token
window; slow: large model, 32768-token window): once with warm-ahead, once cold (warm-ahead off and
another tenant's cache_salt). Each turn adds about 1K tokens of tool output (--rows); the user's think time
between turns (150 s) is told to the cooldown clock rather than slept, and any warm fired in a turn is
allowed to finish before the next turn, as it would during real think time.

    python benchmarks/warm_ahead.py            # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import logging

import structlog

from agentkv.demo.runs import DemoConfig, run_both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-window", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=15, help="tool-result rows per turn (~70 tokens each)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    config = DemoConfig(fast_window=args.fast_window, slow_window=2 * args.fast_window, result_rows=args.rows,
                        turns_after_escalation=0, max_turns=40, tool_latency_s=0.0, max_tokens=4,
                        warm_timeout_s=600.0)
    warm, cold = run_both(config)
    for run in (warm, cold):
        print(f"{run.label:10s}: " + "  ".join(
            f"t{r.turn}:{r.input_tokens}tok/{r.backend}/{r.warm or '-'}/{r.ttft_s:.2f}s/{r.cached_tokens}c" for r in run.rows))
    hot, cool = warm.escalation(), cold.escalation()
    if hot is None or cool is None:
        print("no escalation happened")
        return
    ratio = hot.ttft_s / cool.ttft_s
    print(f"escalation at {hot.input_tokens} tokens: TTFT warm {hot.ttft_s * 1000:.0f} ms "
          f"({hot.cached_tokens} cached, {hot.cached_tokens / hot.input_tokens:.0%}) vs cold {cool.ttft_s * 1000:.0f} ms "
          f"({cool.cached_tokens} cached)")
    print(f"ratio warm/cold = {ratio:.3f}  (target <= 0.2: {'met' if ratio <= 0.2 else 'NOT met'}); "
          f"warms fired: {warm.stats['warm_fired']}")


if __name__ == "__main__":
    main()
