"""A fleet side by side: the vLLM router's policies, agentkv's own pool, and a plain round-robin balancer, in front of
real vLLM 0.32 CPU replicas of the fast and the slow model.

The same growing tool-using conversations (warmed at 60% of fast's 2048-token window, escalated to slow at about
1.8K tokens, then one more slow turn) run through a Session in each mode, interleaved a turn at a time (as concurrent
users' are, in a shuffled order each round: other conversations' requests pass through the tier between one
conversation's warm and its escalation).
Printed per mode, side by side:

- warm read: the share of the warm's cacheable tokens (whole 128-token blocks) the escalation found cached, mean and
  the worst conversation's;
- fast hits: from a conversation's second fast turn on, the share of its previous fast prompt found cached;
- escalation TTFT ÷ cold: the escalated turn's time (non-streamed, 2 tokens) over a cold turn of the same size through
  the same tier (a conversation never warmed: another tenant's salt), medians;
- requests per replica, max ÷ min, slow tier (and fast tier).

The modes: ``plain`` (a round-robin balancer written here: what a Kubernetes Service does), the vLLM router with
``round_robin``, ``consistent_hash``, ``cache_aware`` and ``sticky_least_loaded`` (the router sees agentkv's routing key
in X-Session-ID), and
``pool`` (agentkv's own: ``Backend(api_base=[...])``, no router).

    python benchmarks/fleet.py                          # 2 fast + 3 slow replicas, 9 conversations per mode
    python benchmarks/fleet.py --conversations 30 --modes pool,consistent_hash

Needs the real-vLLM tier's venv and checkpoints (agentkv.vllm_launch) and vllm-router (installed on first use).
Five vLLM CPU servers hold about 16 GB.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import re
import statistics
import threading
import time
import uuid
from contextlib import ExitStack
from typing import Generator

import httpx
import structlog

from agentkv import Backend, Session, WindowDiscovery
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.state import InProcessStore

TOOLS8 = TOOLS[:8]
BLOCK = 128
_SAMPLE = re.compile(r"^(vllm:request_success_total)(?:\{[^}\n]{0,2000}\})? ([0-9.eE+-]{1,40})$", re.M)


def grow(turns: int, seed: int) -> list[list[dict]]:
    return ScriptedAgent(result_rows=1).conversation(turns, tag=f" Conversation {seed}.")


def requests_served(roots: list[str]) -> list[int]:
    found = []
    for root in roots:
        text = httpx.get(root + "/metrics", timeout=10).text[: 4 << 20]
        found.append(int(sum(float(v) for _, v in _SAMPLE.findall(text))))
    return found


class RoundRobin:
    """A plain round-robin HTTP balancer (a Kubernetes Service's behaviour), on a thread: each request of a path to the
    next replica."""

    def __init__(self, roots: list[str]) -> None:
        import uvicorn

        self.roots, self._cycles = roots, {}  # path -> its own rotation (a /tokenize never pairs with a chat)
        self.port = _free_port()
        self._server = uvicorn.Server(uvicorn.Config(self._app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    interface="asgi3"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _app(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        root = next(self._cycles.setdefault(scope["path"], itertools.cycle(self.roots)))
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.decode() not in ("host", "content-length")}
        async with httpx.AsyncClient(timeout=600) as client:
            answer = await client.request(scope["method"], root + scope["path"], content=body, headers=headers)
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": [(b"content-type", answer.headers.get("content-type", "application/json").encode())]})
        await send({"type": "http.response.body", "body": answer.content})

    def __enter__(self) -> "RoundRobin":
        self._thread.start()
        while not self._server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def _free_port() -> int:
    from agentkv.vllm_launch import free_port

    return free_port()


def conversation(fast: Backend, slow: Backend, seed: int, state: InProcessStore) -> Generator[None, None, dict]:
    """One conversation, a turn per step (the caller interleaves conversations, as concurrent users do); its figures
    are in the dict it returns when it ends."""
    s = Session(fast, slow, discovery=WindowDiscovery(), session_id=f"bench-{seed}-{uuid.uuid4()}", state=state)
    slow_turns, escalation_s = 0, None
    for msgs in grow(16, seed):
        started = time.perf_counter()
        s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
        took = time.perf_counter() - started
        s.drain_warms(120)
        if s.last_route.role == "slow":
            escalation_s = took if slow_turns == 0 else escalation_s
            slow_turns += 1
            if slow_turns > 1:
                break
        yield None
    ledger = list(s.ledger)
    s.close()
    warm = next(e for e in ledger if e.warm == "fire")
    escalated = next(e for e in ledger if e.backend == "slow")
    cacheable = warm.input_tokens // BLOCK * BLOCK
    fast_turns = [e for e in ledger if e.backend == "fast"]
    hits = [min(1.0, (b.cached_tokens or 0) / (a.input_tokens // BLOCK * BLOCK or 1))
            for a, b in zip(fast_turns, fast_turns[1:])]
    return {"warm_read": min(escalated.cached_tokens or 0, cacheable) / cacheable, "fast_hits": hits,
            "escalation_s": escalation_s, "escalation_tokens": escalated.input_tokens}


def interleaved(steps: list[Generator[None, None, dict]], seed: int = 0) -> list[dict]:
    """Run the conversations a turn each, in a shuffled order each round (so that no balancer's rotation lines up
    with the conversations'), until all have ended; their results in order."""
    results: dict[int, dict] = {}
    live = dict(enumerate(steps))  # index -> a conversation still running
    order = random.Random(seed)
    while live:
        for index, step in order.sample(list(live.items()), len(live)):
            try:
                next(step)
            except StopIteration as ended:
                results[index] = ended.value
                del live[index]
    return [results[i] for i in range(len(steps))]


def cold_turn_s(fast: Backend, slow: Backend, tokens: int) -> float:
    """A same-size escalation nobody warmed: a fresh conversation under its own salt, sent straight to slow."""
    s = Session(fast, slow, discovery=WindowDiscovery(), tenant=f"cold-{uuid.uuid4()}", cache_salt_secret="bench")
    history = grow(16, 10_000 + int(time.time() * 1000) % 100_000)
    msgs = next((m for m in history if s.count(messages=m, tools=TOOLS8).total >= tokens), history[-1])
    s.route(messages=msgs, tools=TOOLS8, max_tokens=2)  # discovery done before the clock starts, as a live Session's
    started = time.perf_counter()
    s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
    took = time.perf_counter() - started
    s.close()
    return took


def run_mode(mode: str, fast_tier: str | list[str], slow_tier: str | list[str], fast_roots: list[str],
             slow_roots: list[str], conversations: int) -> dict:
    fast = Backend("hosted_vllm/fast", api_base=fast_tier, name="fast")
    slow = Backend("hosted_vllm/slow", api_base=slow_tier, name="slow")
    before_fast, before_slow = requests_served(fast_roots), requests_served(slow_roots)
    state = InProcessStore()
    results = interleaved([conversation(fast, slow, seed, state) for seed in range(conversations)])
    after_fast, after_slow = requests_served(fast_roots), requests_served(slow_roots)
    slow_counts = [a - b for a, b in zip(after_slow, before_slow)]
    fast_counts = [a - b for a, b in zip(after_fast, before_fast)]
    tokens = int(statistics.median(r["escalation_tokens"] for r in results))
    cold = statistics.median(cold_turn_s(fast, slow, tokens) for _ in range(5))  # the same tier, never warmed
    return {"mode": mode, "warm_read": [r["warm_read"] for r in results],
            "fast_hits": [h for r in results for h in r["fast_hits"]],
            "ttft_ratio": statistics.median(r["escalation_s"] for r in results) / cold,
            "slow_counts": slow_counts, "fast_counts": fast_counts}


def spread(counts: list[int]) -> str:
    return "inf" if min(counts) == 0 else f"{max(counts) / min(counts):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-replicas", type=int, default=2)
    parser.add_argument("--slow-replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--modes", default="plain,round_robin,consistent_hash,cache_aware,sticky_least_loaded,pool")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    from agentkv.vllm_launch import VLLMRouter, VLLMServer, ensure_models, ensure_router, ensure_venv, start_all

    python, models, router = ensure_venv(), ensure_models(), ensure_router()
    with ExitStack() as stack:
        fast = [VLLMServer(python, models.fast, window=2048, served_name="fast") for _ in range(args.fast_replicas)]
        slow = [VLLMServer(python, models.slow, window=8192, served_name="slow") for _ in range(args.slow_replicas)]
        start_all(*fast, *slow)
        for server in (*fast, *slow):
            stack.callback(server.stop)
        fast_roots, slow_roots = [s.root for s in fast], [s.root for s in slow]
        rows = []
        for mode in args.modes.split(","):
            with ExitStack() as tiers:
                if mode == "pool":
                    fast_tier, slow_tier = [r + "/v1" for r in fast_roots], [r + "/v1" for r in slow_roots]
                elif mode == "plain":
                    fast_tier = tiers.enter_context(RoundRobin(fast_roots)).base_url
                    slow_tier = tiers.enter_context(RoundRobin(slow_roots)).base_url
                else:
                    fast_tier = tiers.enter_context(VLLMRouter(router, fast_roots, policy=mode)).base_url
                    slow_tier = tiers.enter_context(VLLMRouter(router, slow_roots, policy=mode)).base_url
                row = run_mode(mode, fast_tier, slow_tier, fast_roots, slow_roots, args.conversations)
            rows.append(row)
            print_row(row, header=len(rows) == 1)
        print(f"\n{args.conversations} conversations per mode; {args.fast_replicas} fast and {args.slow_replicas} slow "
              "replicas (real vLLM 0.32 CPU); the router is vllm-router 0.1.17.")


def print_row(row: dict, *, header: bool) -> None:
    if header:
        print(f"{'mode':16s} {'warm read mean':>14s} {'worst':>6s} {'>=0.95':>7s} {'fast hits':>9s} "
              f"{'esc TTFT/cold':>13s} {'slow max/min':>12s} {'fast max/min':>12s}  slow, fast requests per replica")
    reads, hits = row["warm_read"], row["fast_hits"]
    print(f"{row['mode']:16s} {statistics.mean(reads):14.2f} {min(reads):6.2f} "
          f"{sum(r >= 0.95 for r in reads):>3d}/{len(reads):<3d} {statistics.mean(hits) if hits else 0:9.2f} "
          f"{row['ttft_ratio']:13.2f} {spread(row['slow_counts']):>12s} {spread(row['fast_counts']):>12s}  "
          f"{row['slow_counts']}, {row['fast_counts']}")


if __name__ == "__main__":
    main()
