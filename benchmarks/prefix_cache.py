"""Time to first token with and without the embedded engine's prefix cache, side by side in one run.

For each prompt length N: a cold request of N tokens (nothing cached), then a request of N tokens that shares its
first 90% with the cold one (so ~90% of it is served from cached blocks and only the rest is prefilled).
Both generate one token; TTFT is prefill plus the first sampling step.

    python benchmarks/prefix_cache.py                              # large model at 2K, 8K and 16K
    python benchmarks/prefix_cache.py --size small --lengths 1024,2000
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

from agentkv.embedded.engine import LocalEngine


@dataclass(frozen=True)
class Row:
    """One prompt length's measurements."""

    tokens: int
    cached_tokens: int
    cold_ttft_s: float
    warm_ttft_s: float

    @property
    def speedup(self) -> float:
        return self.cold_ttft_s / self.warm_ttft_s


def prompt(length: int, rng: random.Random) -> list[int]:
    """``length`` token ids drawn from cl100k_base's ordinary (non-special) range."""
    return [rng.randrange(100_000) for _ in range(length)]


def measure(engine: LocalEngine, length: int, fraction: float, rng: random.Random) -> Row:
    """Cold TTFT of a fresh prompt, then TTFT of a same-length prompt sharing its first ``fraction``."""
    cold_ids = prompt(length, rng)
    shared = int(length * fraction)
    warm_ids = cold_ids[:shared] + prompt(length - shared, rng)
    cold = engine.generate(cold_ids, 1, cache_salt=f"bench-{length}")
    warm = engine.generate(warm_ids, 1, cache_salt=f"bench-{length}")
    assert cold.cached_tokens == 0
    return Row(length, warm.cached_tokens, cold.ttft_s, warm.ttft_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--lengths", default="2048,8192,16384", help="comma-separated prompt lengths")
    parser.add_argument("--cached-fraction", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-threads", type=int, default=None, help="torch threads for prefill")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    import torch

    args = parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    started = time.perf_counter()
    engine = LocalEngine.from_size(args.size, max_model_len=max(lengths) + 1, cache_budget_bytes=2 << 30,
                                   prefill_threads=args.prefill_threads)
    print(f"model agentkv-{args.size}: built in {time.perf_counter() - started:.1f} s; "
          f"{engine.num_layers} layers, KV {engine.kv_heads}x{engine.head_dim} per layer; "
          f"prefill threads {args.prefill_threads or torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    rng = random.Random(args.seed)
    engine.generate(prompt(64, rng), 1)  # warm-up: first-call allocations and kernel selection
    rows = [measure(engine, n, args.cached_fraction, rng) for n in lengths]
    print(f"load average after: {os.getloadavg()[0]:.1f} (the machine's other work slows every figure)")
    print(f"{'tokens':>7} {'cached':>7} {'cold TTFT s':>12} {'cached TTFT s':>14} {'speedup':>8}")
    for row in rows:
        print(f"{row.tokens:>7} {row.cached_tokens:>7} {row.cold_ttft_s:>12.2f} {row.warm_ttft_s:>14.2f} "
              f"{row.speedup:>7.1f}x")
    return rows


if __name__ == "__main__":
    main()
