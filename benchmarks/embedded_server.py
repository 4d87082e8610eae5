"""The embedded server's costs, measured side by side: structured-output overhead per token, time to cancel.

1. Decode time per generated token on the ``small`` model (100,352-token vocabulary), unconstrained and under an
   xgrammar JSON grammar, same prompt, greedy: the difference is the grammar's per-token cost.
2. Time from a streaming client's disconnect to the engine being idle again (the request aborted, its KV freed).

Usage::

    python benchmarks/embedded_server.py [--tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from agentkv.local.grammar import GrammarSpec
from agentkv.local.sampling import SamplingParams
from agentkv.local.server import LocalServer

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


def per_token_ms(server: LocalServer, prompt: list[int], tokens: int, reps: int, grammar: object) -> float:
    """Median decode milliseconds per generated token (prefill excluded) over ``reps`` requests."""
    samples = []
    for rep in range(reps):
        params = SamplingParams(max_tokens=tokens, ignore_eos=grammar is None, grammar=grammar, seed=rep)
        result = server.engine.generate(prompt, params=params)
        decoded = result.completion_tokens - 1
        if decoded > 0:
            samples.append((result.total_s - result.ttft_s) / decoded * 1000)
    return statistics.median(samples)


def cancel_ms(server: LocalServer, reps: int) -> float:
    """Median milliseconds from closing a streaming response to the engine having no running request."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    samples = []
    for _ in range(reps):
        with httpx.stream("POST", server.api_base + "/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            closed = time.perf_counter()
        while server.engine.stats().running:
            time.sleep(0.0005)
        samples.append((time.perf_counter() - closed) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with LocalServer.from_size("small", window=2048) as server:
        prompt = server.engine.tokenize_chat([{"role": "user", "content": "Write notes as JSON."}])
        grammar = server.compile_grammar(GrammarSpec("json", SCHEMA))
        per_token_ms(server, prompt, 8, 1, grammar)  # warm the grammar compiler and caches
        free = per_token_ms(server, prompt, args.tokens, args.reps, None)
        bound = per_token_ms(server, prompt, args.tokens, args.reps, grammar)
        print(f"decode per token, small model: unconstrained {free:.2f} ms, json grammar {bound:.2f} ms "
              f"-> overhead {bound - free:.2f} ms/token, ratio {bound / free:.2f}x")
        print(f"disconnect to idle (request aborted, KV freed): median {cancel_ms(server, args.reps):.1f} ms "
              f"over {args.reps} streams")


if __name__ == "__main__":
    main()
