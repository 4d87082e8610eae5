"""What sharing the guards through Redis costs per request, and what it saves across 8 replicas.

1. Per-request overhead: the same Session workload (discovered windows, a warm-ahead claim on every
   request past the threshold) with the in-process store and with a RedisStore on a local
   redis-server, side by side, best of three; the difference is the store's round trips.
2. Warms sent by 8 processes on the same workload (every conversation's turn k on process k), with
   each process's own guards and with one RedisStore: the guards' purpose is one warm per session.

    python benchmarks/shared_state.py          # starts its own redis-server; about 30 s on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import time
import uuid
from typing import Any

import structlog

from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.state import InProcessStore, RedisStore, StateStore
from agentkv.testing import FakeHttp, models_answer
from agentkv.testing.servers import redis_server

FAST, SLOW = "http://127.0.0.1:9401/v1", "http://127.0.0.1:9402/v1"
FILLER = "check the disk latency graphs and the queue depth "


def models(method: str, url: str, body: Any) -> Any:
    return models_answer("fast-m", 2048) if url.startswith(FAST) else models_answer("slow-m", 16384)


class Answers:
    """Answers every request at once; a warm takes ``warm_s`` (on the warm's own thread)."""

    def __init__(self, warm_s: float = 0.0) -> None:
        self.warm_s = warm_s

    def completion(self, **kwargs: Any) -> Any:
        if kwargs.get("max_tokens") == 1:
            time.sleep(self.warm_s)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    async def acompletion(self, **kwargs: Any) -> Any:
        if kwargs.get("max_tokens") == 1:
            await asyncio.sleep(self.warm_s)
        return self.completion(**{**kwargs, "max_tokens": 0})


def seam(warm_s: float) -> FakeHttp:
    """The HTTP seam: /v1/models, and the raw POST warms self-hosted backends get (taking ``warm_s`` each)."""
    def handle(method: str, url: str, body: Any) -> Any:
        if method == "POST" and url.endswith("/chat/completions"):
            time.sleep(warm_s)
            return {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        return models(method, url, body)

    return FakeHttp(handle)


def session(store: StateStore, discovery: WindowDiscovery, client: Answers, sid: str) -> Session:
    return Session(Backend("hosted_vllm/fast-m", api_base=FAST, name="fast"),
                   Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow"), tenant="bench", session_id=sid,
                   cache_salt_secret="bench-secret",
                   state=store, discovery=discovery, client=client, http=seam(client.warm_s), count_with_server=False,
                   warm_ahead=WarmAheadPolicy(timeout_s=5))


def messages(sid: str, turn: int, repeats: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"conversation {sid}"}, {"role": "user", "content": FILLER * repeats},
            {"role": "user", "content": f"turn {turn}"}]


def per_request_ms(store: StateStore, repeats: int, requests: int) -> float:
    """Mean ms per completion for one Session (warms past the first hit the cooldown: one claim each)."""
    shared = None if isinstance(store, InProcessStore) else store
    s = session(store, WindowDiscovery(http=FakeHttp(models), state=shared), Answers(), uuid.uuid4().hex)
    s.completion(messages=messages("w", 0, repeats), max_tokens=8)  # discovery and the first warm, not timed
    s.drain_warms(10)
    start = time.perf_counter()
    for i in range(requests):
        s.completion(messages=messages("w", i, repeats), max_tokens=8)
    elapsed = (time.perf_counter() - start) * 1000 / requests
    expected = "warm_skipped_cooldown" if repeats > 100 else "requests_total"
    assert s.stats()[expected] >= requests, s.stats()  # past the threshold, every request made a claim
    return elapsed


async def aper_request_ms(store: StateStore, repeats: int, requests: int) -> float:
    """:func:`per_request_ms` through ``acompletion`` (the asyncio Redis client)."""
    shared = None if isinstance(store, InProcessStore) else store
    s = session(store, WindowDiscovery(http=FakeHttp(models), state=shared), Answers(), uuid.uuid4().hex)
    await s.acompletion(messages=messages("w", 0, repeats), max_tokens=8)
    await s.adrain_warms(10)
    start = time.perf_counter()
    for i in range(requests):
        await s.acompletion(messages=messages("w", i, repeats), max_tokens=8)
    return (time.perf_counter() - start) * 1000 / requests


def side_by_side(measure: Any, redis_store: RedisStore, rounds: int = 5) -> tuple[float, float]:
    """Best of ``rounds`` for each store, the two measured alternately (a shared machine's load hits both)."""
    local, shared = [], []
    for _ in range(rounds):
        local.append(measure(InProcessStore()))
        shared.append(measure(redis_store))
    return min(local), min(shared)


def replica(url: str | None, namespace: str, index: int, conversations: int, out: Any) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    store: StateStore = RedisStore.from_url(url, namespace=namespace, timeout_s=0.5) if url else InProcessStore()
    discovery = WindowDiscovery(http=FakeHttp(models), state=None if url is None else store)
    client, sessions = Answers(warm_s=0.02), []
    for c in range(conversations):
        s = session(store, discovery, client, f"conv-{c}")
        s.completion(messages=messages(f"conv-{c}", index, 140), max_tokens=8)
        sessions.append(s)
    for s in sessions:
        s.drain_warms(10)
    out.put((sum(s.stats()["warm_completed"] for s in sessions),
             sum(s.stats()["warm_skipped_saturated"] for s in sessions)))


def fleet_warms(url: str | None, processes: int, conversations: int) -> tuple[int, int]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    namespace = uuid.uuid4().hex
    procs = [context.Process(target=replica, args=(url, namespace, i, conversations, out)) for i in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return sum(r[0] for r in results), sum(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=50)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    with redis_server() as url:
        redis_store = RedisStore.from_url(url, namespace=uuid.uuid4().hex)
        for label, repeats in (("below the warm threshold", 60), ("past it (a claim per request)", 140)):
            local, shared = side_by_side(lambda store, r=repeats: per_request_ms(store, r, args.requests), redis_store)
            print(f"per request, {label}: in-process {local:.3f} ms, RedisStore {shared:.3f} ms, "
                  f"overhead {shared - local:+.3f} ms ({shared / local:.2f}x)")
            local, shared = side_by_side(lambda store, r=repeats: asyncio.run(aper_request_ms(store, r, args.requests)),
                                         redis_store)
            print(f"  async, {label}: in-process {local:.3f} ms, RedisStore {shared:.3f} ms, "
                  f"overhead {shared - local:+.3f} ms ({shared / local:.2f}x)")
        alone = fleet_warms(None, args.processes, args.conversations)
        together = fleet_warms(url, args.processes, args.conversations)
    print(f"{args.processes} processes x {args.conversations} conversations, each conversation's turn k on process k:")
    print(f"  warms sent: in-process guards {alone[0]} (saturated skips {alone[1]}), "
          f"shared RedisStore {together[0]} (saturated skips {together[1]}); "
          f"one per conversation would be {args.conversations}")


if __name__ == "__main__":
    main()
