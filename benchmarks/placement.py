"""Placing a new conversation in a pool (choosing its home) with 1k, 100k and 1M conversations already active, in
process and through Redis: p50 and p99 per placement, and p99 at 1M over p99 at 1k (the target is at most 1.5).

Each figure times ``store.home_replica`` for conversations the store has never seen (the path that used to count every
active conversation), over a 3-replica pool, with the pool filled by other tenants' conversations first. The stores
are built with ``max_active=2_000_000`` so that 1M active is under the bound and every timed placement takes the full
bounded-load path (at the default bound of 1M, a million active conversations would send new ones down the cheaper
rendezvous-only path). Each size is its own pool, and samples are taken from the pools in turn, so that other work on
the machine falls on every size alike; p99 is the median of 5 rounds' p99s. Redis is a throwaway local redis-server;
its pools are filled with a pipeline in the store's own layout (a million script calls would take minutes), the
in-process store's through its own placements.

    python benchmarks/placement.py                      # 1k, 100k, 1M; both stores
    python benchmarks/placement.py --sizes 1000,100000 --samples 5000 --rounds 3 --stores memory
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any, Callable

from agentkv.fleet import ranked
from agentkv.state import InProcessStore
from agentkv.testing.servers import redis_server

REPLICAS = ("http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1")
POOL = "slow|bench"
IDLE_S = 900.0
TENANTS = 1000  # the fill is spread over this many tenants, none past its share
BOUND = 2_000_000


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def interleaved(places: dict[int, Callable[[str], Any]], samples: int, rounds: int = 1) -> dict[int, tuple[float, float]]:
    """p50 and p99 (ms) of placements of new conversations per pool: ``rounds`` rounds of ``samples`` each, taken in
    turn from each pool (so that whatever else runs on the machine falls on every size alike); the p50 of all, the
    median of the rounds' p99s (one burst of other work moves one round's, not the figure)."""
    times: dict[int, list[list[float]]] = {size: [] for size in places}
    for _ in range(rounds):
        for found in times.values():
            found.append([])
        for _ in range(samples):
            for size, place in places.items():
                key = uuid.uuid4().hex
                start = time.perf_counter()
                place(key)
                times[size][-1].append((time.perf_counter() - start) * 1000)
    return {size: (statistics.median([t for one in found for t in one]),
                   statistics.median([percentiles(one)[1] for one in found])) for size, found in times.items()}


def memory_figures(sizes: list[int], samples: int, rounds: int) -> dict[int, tuple[float, float]]:
    store = InProcessStore(max_active=BOUND)
    order = ranked("any", REPLICAS)
    for size in sizes:
        for i in range(size):
            store.home_replica(f"{POOL}-{size}", f"fill-{i}", order, (), slack=1.0, idle_s=IDLE_S,
                               tenant=f"t{i % TENANTS}")
    return interleaved({size: _placer(store, f"{POOL}-{size}") for size in sizes}, samples, rounds)


def _placer(store: Any, pool: str) -> Callable[[str], Any]:
    return lambda key: store.home_replica(pool, key, ranked(key, REPLICAS), (), slack=1.0, idle_s=IDLE_S,
                                          tenant="new")


def fill_redis(store: Any, pool: str, size: int) -> None:
    """``size`` conversations active now in ``pool``, in the store's own layout (the homes, last seen, counts)."""
    keys = store.keys
    ids = [keys.id("replica", url) for url in REPLICAS]
    now_ms = int(store.client.time()[0]) * 1000
    pipe = store.client.pipeline(transaction=False)
    per_replica: dict[str, int] = {}
    per_tenant: dict[str, int] = {}
    for chunk in range(0, size, 10_000):
        homes, seen = {}, {}
        for i in range(chunk, min(size, chunk + 10_000)):
            conversation, tenant = keys.id("conversation", f"fill-{i}"), keys.id("tenant", f"t{i % TENANTS}")
            homes[conversation], seen[conversation] = f"{ids[i % 3]} {tenant}", now_ms
            per_replica[ids[i % 3]] = per_replica.get(ids[i % 3], 0) + 1
            per_tenant[tenant] = per_tenant.get(tenant, 0) + 1
        pipe.hset(keys.homes(pool), mapping=homes)
        pipe.zadd(keys.seen(pool), seen)
        pipe.execute()
    counts = {f"r:{k}": v for k, v in per_replica.items()} | {f"t:{k}": v for k, v in per_tenant.items()}
    pipe.hset(keys.counts(pool), mapping=counts)
    for key in (keys.homes(pool), keys.seen(pool), keys.counts(pool)):
        pipe.pexpire(key, int(IDLE_S * 1000))
    pipe.execute()


def redis_figures(sizes: list[int], samples: int, rounds: int) -> dict[int, tuple[float, float]]:
    from agentkv.state import RedisStore

    with redis_server() as url:
        store = RedisStore.from_url(url, namespace="bench", timeout_s=1.0, max_active=BOUND)
        for size in sizes:
            fill_redis(store, f"{POOL}-{size}", size)
        places = {size: _placer(store, f"{POOL}-{size}") for size in sizes}
        interleaved(places, 100)  # the script loaded, the connection open
        figures = interleaved(places, samples, rounds)
        store.close()
    return figures


def report(name: str, figures: dict[int, tuple[float, float]]) -> None:
    for size, (p50, p99) in figures.items():
        print(f"{name:9} {size:>9,} active   p50 {p50:7.3f} ms   p99 {p99:7.3f} ms")
    small, large = min(figures), max(figures)
    print(f"{name:9} p99({large:,}) / p99({small:,}) = {figures[large][1] / figures[small][1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--samples", type=int, default=2000, help="placements per pool per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stores", default="memory,redis")
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))
    for name in args.stores.split(","):
        figures = (memory_figures if name == "memory" else redis_figures)(sizes, args.samples, args.rounds)
        report(name, figures)


if __name__ == "__main__":
    main()
