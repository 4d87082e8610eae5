"""The embedded server's costs, measured side by side: structured-output overhead per token, time to cancel.

1. Decode time per generated token on the ``small`` model (100,352-token vocabulary), unconstrained and under an
   xgrammar JSON grammar, same prompt, greedy: the difference is the grammar's per-token cost.
2. Time from a streaming client's disconnect to the engine being idle again (the request aborted, its KV freed).

Usage::

    python benchmarks/embedded_server.py [--tokens 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from agentkv.embedded.engine.grammar import GrammarSpec
from agentkv.embedded.engine.sampling import SamplingParams
from agentkv.embedded.server import LocalServer

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


def decode_ms(server: LocalServer, prompt: list[int], tokens: int, grammar: object) -> tuple[float, list[int]]:
    """Decode milliseconds per generated token (prefill excluded) of one greedy request, and its tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=grammar is None, grammar=grammar, seed=0)
    result = server.engine.generate(prompt, params=params)
    return (result.total_s - result.ttft_s) / max(1, result.completion_tokens - 1) * 1000, result.token_ids


def side_by_side(server: LocalServer, prompt: list[int], tokens: int, reps: int, grammar: object
                 ) -> tuple[float, float, list[int]]:
    """Median per-token decode time unconstrained and constrained, runs alternated so load drifts hit both."""
    free, bound, output = [], [], []
    for _ in range(reps):
        free.append(decode_ms(server, prompt, tokens, None)[0])
        ms, output = decode_ms(server, prompt, tokens, grammar)
        bound.append(ms)
    return statistics.median(free), statistics.median(bound), output


def mask_ms(grammar: object, output: list[int], vocab: int, reps: int) -> float:
    """Median milliseconds per token for the grammar alone: mask a [vocab] row and accept, replaying ``output``."""
    import torch

    from agentkv.embedded.engine.models import intra_op_threads

    samples = []
    for _ in range(reps):
        matcher = grammar.matcher()  # type: ignore[attr-defined]
        logits = torch.zeros(vocab)
        with intra_op_threads(1):  # as the engine samples
            started = time.perf_counter()
            for token in output:
                matcher.mask(logits)
                matcher.accept(token)
            samples.append((time.perf_counter() - started) / len(output) * 1000)
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
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    with LocalServer.from_size("small", window=2048) as server:
        prompt = server.engine.tokenize_chat([{"role": "user", "content": "Write notes as JSON."}])
        grammar = server.compile_grammar(GrammarSpec("json", SCHEMA))
        decode_ms(server, prompt, 8, grammar)  # warm the grammar compiler and caches
        free, bound, output = side_by_side(server, prompt, args.tokens, args.reps, grammar)
        alone = mask_ms(grammar, output, server.engine.vocab_size, args.reps)
        print(f"decode per token, small model: unconstrained {free:.2f} ms, json grammar {bound:.2f} ms "
              f"(ratio {bound / free:.2f}x); the grammar alone (mask + accept, {len(output)} tokens replayed): "
              f"{alone:.2f} ms/token = {alone / free:.0%} of an unconstrained step")
        print(f"disconnect to idle (request aborted, KV freed): median {cancel_ms(server, args.reps):.1f} ms "
              f"over {args.reps} streams")


if __name__ == "__main__":
    main()
