"""Tenant-fair eviction against vLLM's LRU: tenant B's hit rate while tenant A floods the same server.

Two embedded servers, one per policy (``--eviction-policy fair`` / ``lru``), the same bounded block pool and the
same traffic over HTTP, side by side: tenant B is an agent whose conversation grows by one turn per round (its
system prompt and history are its hot prefix); between two of B's turns tenant A sends ``--flood`` requests, each
a batch job with its own system prompt and a distinct document. Printed per policy: B's hit rate (cached ÷ prompt
tokens over its turns after the first), A's, B's mean time to first token, and the evictions.

    python benchmarks/fair_eviction.py [--size tiny] [--blocks 96] [--rounds 6] [--flood 4]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

import httpx
import structlog

from agentkv.embedded.engine import LocalEngine
from agentkv.embedded.server import LocalServer

B_SYSTEM = "You are tenant B's code reviewer. Cite the file and the line for every claim, and be brief. " * 3
A_SYSTEM = "You are tenant A's batch summariser: one line per log entry, no commentary. "


def ask(server: LocalServer, messages: list[dict[str, str]], salt: str) -> tuple[int, int, float]:
    """One chat request: (prompt tokens, cached tokens, seconds to the answer of one token)."""
    body = {"model": server.model_id, "messages": messages, "max_tokens": 1, "cache_salt": salt}
    start = time.perf_counter()
    usage = httpx.post(f"{server.api_base}/chat/completions", json=body, timeout=600).json()["usage"]
    return int(usage["prompt_tokens"]), int(usage["prompt_tokens_details"]["cached_tokens"]), \
        time.perf_counter() - start


def run(server: LocalServer, rounds: int, flood: int) -> dict[str, Any]:
    """B's growing conversation with A's flood between its turns; hit rates and B's latency."""
    history = [{"role": "system", "content": B_SYSTEM}]
    b_prompt = b_cached = a_prompt = a_cached = 0
    b_ttft: list[float] = []
    for turn in range(rounds):
        history.append({"role": "user", "content": f"Review hunk {turn} of the patch: does it keep the lock order?"})
        prompt, cached, seconds = ask(server, history, "salt-b")
        if turn:
            b_prompt, b_cached = b_prompt + prompt, b_cached + cached
            b_ttft.append(seconds)
        history.append({"role": "assistant", "content": f"Hunk {turn}: the lock order is kept (file.py:{turn})."})
        for job in range(flood):
            document = " ".join(f"entry {turn}.{job}.{line}: request served in {line * 7 % 97} ms"
                                for line in range(24))
            prompt, cached, _ = ask(server, [{"role": "system", "content": A_SYSTEM},
                                             {"role": "user", "content": document}], "salt-a")
            a_prompt, a_cached = a_prompt + prompt, a_cached + cached
    return {"b_hit": b_cached / max(b_prompt, 1), "a_hit": a_cached / max(a_prompt, 1),
            "b_ttft": statistics.mean(b_ttft), "evictions": server.engine.prefix_cache.evictions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--blocks", type=int, default=96, help="the block pool (--num-gpu-blocks-override)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--flood", type=int, default=4, help="A's requests between two of B's turns")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = {}
    for policy in ("fair", "lru"):
        engine = LocalEngine.from_size(args.size, max_model_len=2048, num_blocks=args.blocks, eviction_policy=policy)
        with LocalServer(engine) as server:
            results[policy] = run(server, args.rounds, args.flood)
    print(f"load average {os.getloadavg()[0]:.2f}; size {args.size}, pool {args.blocks} blocks of 16, "
          f"{args.rounds} rounds of B, {args.flood} A requests between B's turns")
    print(f"{'policy':<8}{'B hit rate':>12}{'A hit rate':>12}{'B TTFT ms':>12}{'evictions':>11}")
    for policy, r in results.items():
        print(f"{policy:<8}{r['b_hit']:>12.3f}{r['a_hit']:>12.3f}{r['b_ttft'] * 1000:>12.1f}{r['evictions']:>11}")
    fair, lru = results["fair"], results["lru"]
    print(f"B's TTFT fair / lru = {fair['b_ttft'] / lru['b_ttft']:.2f}; "
          f"B's hit rate fair - lru = {fair['b_hit'] - lru['b_hit']:+.3f}")


if __name__ == "__main__":
    main()
