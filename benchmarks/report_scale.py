"""What `agentkv report` costs at scale: ledgers of 10k and 100k rows, and JSON-lines event logs of 10k and 40k
conversations (two turns each: a fast `route` event and a `turn_answered` event per turn).

Each case runs `agentkv report FILE --out PNG` in a fresh Python process and prints its wall time (from the command's
start to the PNG written, imports included) and the process's peak resident memory (`resource.getrusage`); with
`--traced`, also the peak traced memory of the report alone (`tracemalloc`, which slows it).

    python benchmarks/report_scale.py [--traced] [--cases ledger-10k,ledger-100k,log-10k,log-40k]

Issue 37 measured the code before this round: 10k rows in 142 s and 566 MB; 100k rows unfinished after 240 s at
4.1 GB; an event log of 40k sessions in 20.6 s (1.9 s at 10k).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from agentkv.report import write_ledger
from agentkv.stats import LedgerEntry

CHILD = """
import json, resource, sys, time
started = time.perf_counter()
traced = sys.argv[1] == "traced"
if traced:
    import matplotlib.pyplot, tracemalloc  # matplotlib's import is not the report's cost
    tracemalloc.start()
from agentkv.cli import main
code = main(["report", *sys.argv[2:]])
seconds = time.perf_counter() - started
peak = tracemalloc.get_traced_memory()[1] if traced else None
print(json.dumps({"code": code, "seconds": seconds, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "traced": peak}))
"""


def entry(turn: int, session_turns: int = 3000) -> LedgerEntry:
    """Turn ``turn`` of a long conversation: grows to fast's edge, escalates, warms once a cycle."""
    phase = turn % session_turns
    slow = phase >= 2 * session_turns // 3
    return LedgerEntry(turn, 1000 + phase, 100, 0.05, "template", True, "slow" if slow else "fast",
                       "over_fast_window" if slow else "fits_fast", "fire" if phase == session_turns // 2 else "none",
                       500 if slow else 0)


def ledger(folder: Path, rows: int) -> Path:
    return write_ledger(folder / f"ledger-{rows}.jsonl", (entry(t) for t in range(1, rows + 1)), fast_window=4096,
                        output_floor=256, warm_threshold=0.6)


def event_log(folder: Path, sessions: int, turns: int = 2) -> Path:
    path = folder / f"log-{sessions}.jsonl"
    with path.open("w") as out:
        for n in range(sessions):
            for turn in range(1, turns + 1):
                out.write(json.dumps({"event": "route", "session": f"s{n}", "role": "fast", "window": 4096,
                                      "floor": 256, "level": "debug"}) + "\n")
                out.write(json.dumps({"event": "turn_answered", "session": f"s{n}", "level": "info",
                                      **asdict(entry(turn))}) + "\n")
    return path


def run(path: Path, out: Path, traced: bool) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, "traced" if traced else "plain", str(path), "--out", str(out)],
                          capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--traced", action="store_true", help="also the peak traced memory (tracemalloc)")
    parser.add_argument("--cases", default="ledger-10k,ledger-100k,log-10k,log-40k")
    args = parser.parse_args()
    makers = {"ledger-10k": lambda d: ledger(d, 10_000), "ledger-100k": lambda d: ledger(d, 100_000),
              "log-10k": lambda d: event_log(d, 10_000), "log-40k": lambda d: event_log(d, 40_000)}
    with tempfile.TemporaryDirectory() as folder:
        print(f"{'case':<12} {'MB in':>6} {'seconds':>8} {'peak RSS MB':>12}" + (f" {'traced MB':>10}" if args.traced
                                                                               else ""))
        for case in args.cases.split(","):
            path = makers[case](Path(folder))
            plain = run(path, Path(folder) / f"{case}.png", traced=False)
            assert plain["code"] == 0, plain
            line = (f"{case:<12} {path.stat().st_size / 2**20:>6.1f} {plain['seconds']:>8.2f} "
                    f"{plain['rss'] / 2**20:>12.0f}")
            if args.traced:
                line += f" {run(path, Path(folder) / f'{case}-t.png', traced=True)['traced'] / 2**20:>10.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
