"""KV handoff: time to map a source cache into the target's vs time for the target to re-prefill, side by side.

    python benchmarks/handoff.py                       # embedded small -> large on CPU, 512 / 2K / 8K tokens
    python benchmarks/handoff.py --lengths 512,2048    # other lengths
    python benchmarks/handoff.py --gpu                 # Qwen3-14B -> 32B shapes, random bf16 weights, CUDA, 4K-32K

The mapper is a ridge map with the real shapes (k = min(8, source layers) source layers per target
layer) and random weights: its cost does not depend on the weights' values. ``--mapper DIR`` times a
calibrated one instead. Lengths whose caches would not fit in free memory are skipped.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from agentkv.handoff.offline.cli import add_bench_arguments, run_bench

DEFAULT_LENGTHS = "512,2048,8192"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/handoff.py", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    args = parser.parse_args(["handoff", *(sys.argv[1:] if argv is None else argv)])
    if args.lengths is None and not args.gpu:
        args.lengths = DEFAULT_LENGTHS
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
