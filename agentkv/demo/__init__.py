"""``agentkv demo``: a scripted ReAct agent on two embedded servers, warm-ahead against cold.

Two vLLM-compatible servers start on free loopback ports: fast (small model, 2048-token window) and
slow (larger model, 16384-token window). A scripted agent's conversation grows turn by turn through
``Session`` -> litellm -> HTTP. The run is made twice: with warm-ahead, and cold (warm-ahead off and
another tenant's ``cache_salt``, so the slow server has nothing of the first run to hit). The headline
compares the escalated turn's time to first token in the two runs.

- :mod:`.runs`: the runs and their rows; :mod:`.report`: the table, headline and plot;
  :mod:`.script`: the scripted agent and its tools.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentkv.demo import runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny models and fewer turns (for tests)")
    parser.add_argument("--out", default="agentkv-demo.png", help="where to write the plot (PNG)")
    parser.add_argument("--tools", type=int, default=None, help="how many tool schemas the agent carries")
    parser.add_argument("--trained", nargs="?", const="full", default=None, choices=("micro", "full"),
                        help="serve a model family trained here on the Python standard library instead of random "
                             "weights (trained first and cached: `full` about 15 min on 2 cores, `micro` about 1 min)")
    parser.add_argument("--engine", choices=("embedded", "vllm"), default="embedded",
                        help="who serves: the embedded engine (default) or the real vLLM CPU build (installed into "
                             "its own venv under ~/.cache/agentkv on first use, about 2 min)")


def run(args: argparse.Namespace) -> int:
    config = runs.DemoConfig.quick() if args.quick else runs.DemoConfig()
    if args.tools:
        config = runs.DemoConfig(**{**config.__dict__, "tools": args.tools})
    if args.engine == "vllm":  # the tier's checkpoints; the slow window leaves the CPU prefill a few seconds
        config = runs.DemoConfig(**{**config.__dict__, "engine": "vllm", "slow_window": 8192})
    if args.trained:  # the family's template renders no tool schemas: turns are shorter, so allow more of them
        config = runs.DemoConfig(**{**config.__dict__, "trained": args.trained, "max_turns": 24})
    config = runs.DemoConfig(**{**config.__dict__, "ledger_dir": str(Path(args.out).parent)})
    _quiet_logs()
    from rich.console import Console

    from agentkv.demo.report import headline, plot, table

    console = Console(width=max(Console().width, 100))  # the table needs ~90 columns, also when piped
    console.print(f"[bold]agentkv demo[/bold] — {_honesty(config)}")
    console.print(f"Pacing: {config.tool_latency_s}s of tool time per turn, plus {config.think_time_s:.0f}s of user think "
                  "time told to the warm-ahead cooldown clock (5 min per session) instead of slept.")
    warm_run, cold_run = runs.run_both(config, console)
    console.print(table(warm_run, config))
    console.print(table(cold_run, config))
    console.print(headline(warm_run, cold_run))
    path = plot(warm_run, cold_run, config, Path(args.out))
    console.print(f"plot written to {path}")
    if warm_run.ledger is not None:
        from agentkv.report import life_of, read_ledger
        from agentkv.report.plot import draw

        life = draw(life_of(*read_ledger(warm_run.ledger)), Path(args.out).with_name(f"{Path(args.out).stem}-life.png"),
                    title="the warm-ahead run's conversation")
        console.print(f"its life, turn by turn: {life} (again with `agentkv report {warm_run.ledger}`)")
    return 0


def _honesty(config: runs.DemoConfig) -> str:
    if config.engine == "vllm":
        return runs.REAL_VLLM
    return runs.TRAINED if config.trained else runs.HONESTY


def _quiet_logs() -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
