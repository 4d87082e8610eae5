"""Tenant-fair eviction: the pure decision, the prefix cache applying it, and two real servers (fair vs LRU)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from agentkv.embedded.engine.eviction import GroupFacts, check_policy, victim_group

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.engine.models import build_model  # noqa: E402
from agentkv.embedded.engine.prefix_cache import KVBlock, PrefixCache  # noqa: E402

BLOCK = 4


def make_block() -> KVBlock:
    return KVBlock(torch.zeros(1, 1, BLOCK, 2), torch.zeros(1, 1, BLOCK, 2))


def fill(cache: PrefixCache, start: int, blocks: int, salt: str | None) -> list[bytes]:
    hashes = cache.hashes(list(range(start, start + blocks * BLOCK)), salt)
    cache.insert(hashes, lambda i: make_block())
    return hashes


def resident(cache: PrefixCache, chain: list[bytes]) -> int:
    return sum(key in cache for key in chain)


# --- the pure decision --------------------------------------------------------------------------------


def test_fair_picks_the_group_furthest_over_its_share_then_the_colder():
    """Fair: the biggest holder gives up a block even when another group's block is colder; ties go to the colder."""
    big, small = GroupFacts("a", used=900, coldest=50), GroupFacts("b", used=100, coldest=1)
    assert victim_group("fair", [big, small], capacity=1000, groups=2) == big
    assert victim_group("lru", [big, small], capacity=1000, groups=2) == small
    even = [GroupFacts("a", 500, 7), GroupFacts(None, 500, 3)]
    assert victim_group("fair", even, capacity=1000, groups=2) == even[1]
    assert victim_group("fair", [], capacity=1000, groups=0) is None


def test_a_group_over_its_share_never_takes_from_one_under_it():
    """Fair: an inserting group at or over its share with nothing of its own to give gets no room from a group
    under its share (LRU would give it the colder block); a group under its share does get room."""
    under = [GroupFacts("b", used=300, coldest=1)]
    assert victim_group("fair", under, capacity=1000, groups=2, incoming=GroupFacts("a", 700, 0)) is None
    assert victim_group("lru", under, capacity=1000, groups=2, incoming=GroupFacts("a", 700, 0)) == under[0]
    over = [GroupFacts("b", used=800, coldest=1)]
    assert victim_group("fair", over, capacity=1000, groups=2, incoming=GroupFacts("a", 200, 0)) == over[0]


def test_an_unknown_policy_is_refused():
    """Only "fair" and "lru" are policies."""
    assert check_policy("lru") == "lru"
    with pytest.raises(ValueError, match="fair, lru"):
        check_policy("lfu")


# --- the prefix cache and the engine applying it ---------------------------------------------------------------------


@pytest.mark.parametrize("policy, survives", [("fair", True), ("lru", False)])
def test_a_flood_evicts_its_own_blocks_under_fair_and_the_victims_under_lru(policy, survives):
    """B's older prefix survives A's flood under fair eviction and is evicted under LRU; the bound holds."""
    cache = PrefixCache(block_size=BLOCK, num_blocks=10, policy=policy)
    hot = fill(cache, 0, 3, "b")
    for start in range(1000, 1400, 16):
        fill(cache, start, 4, "a")
        assert len(cache) <= 10
    assert resident(cache, hot) == (3 if survives else 0)
    assert cache.group_bytes()["a"] == (7 if survives else 10) * make_block().nbytes
    cache.resize(cache.budget_bytes)  # a new byte budget keeps the block bound
    assert cache.num_blocks == 10 and len(cache) == 10


@pytest.mark.parametrize("policy, survives", [("fair", True), ("lru", False)])
def test_one_prompt_larger_than_the_pool_stops_caching_rather_than_evict_another_tenant(policy, survives):
    """A single chain from A longer than the pool caches only up to A's share under fair; under LRU it takes all."""
    cache = PrefixCache(block_size=BLOCK, num_blocks=10, policy=policy)
    hot = fill(cache, 0, 4, "b")
    covered = cache.insert(cache.hashes(list(range(1000, 1000 + 20 * BLOCK)), "a"), lambda i: make_block())
    assert resident(cache, hot) == (4 if survives else 0)
    assert covered == (6 if survives else 10)


def test_with_one_group_fair_evicts_exactly_as_lru():
    """With every block in one group (unsalted), the fair and LRU caches hold the same blocks after any trace."""
    caches = [PrefixCache(block_size=BLOCK, num_blocks=7, policy=policy) for policy in ("fair", "lru")]
    for cache in caches:
        chains = [fill(cache, 100 * i, 1 + i % 3, None) for i in range(12)]
        cache.match(chains[2])
        fill(cache, 5000, 3, None)
    assert caches[0].keys() == caches[1].keys()


def test_pinned_blocks_are_never_evicted_and_rejoin_tail_first():
    """A pinned chain outlives pressure; unpinned, its tail goes before its head; a clear voids old pins."""
    cache = PrefixCache(block_size=BLOCK, num_blocks=4, policy="lru")
    chain = fill(cache, 0, 3, "b")
    pins = cache.pin(chain)
    assert fill(cache, 500, 3, "a") and resident(cache, chain) == 3 and len(cache) == 4
    cache.unpin(pins)
    fill(cache, 900, 2, "a")  # the two coldest evictable: A's block from before the unpin, then the chain's tail
    assert [key in cache for key in chain] == [True, True, False]
    stale = cache.pin(chain[:1])
    cache.clear()
    fill(cache, 0, 1, "b")
    live = cache.pin(chain[:1])
    cache.unpin(stale)  # taken before the clear: void, so it cannot release the live pin
    cache.resize(cache.budget_bytes, num_blocks=0)
    assert chain[0] in cache
    cache.unpin(live)
    cache.resize(cache.budget_bytes, num_blocks=0)
    assert len(cache) == 0


def test_an_insert_that_fails_part_way_still_reports_what_it_stored_and_evicted():
    """When building a block raises mid-chain, the blocks already added and the evictions that made room are
    published at once, so a subscriber's view matches the cache (no later BlockRemoved for an unannounced block)."""
    cache = PrefixCache(block_size=BLOCK, num_blocks=3, policy="lru")
    seen: set[bytes] = set()

    def apply(events: list[Any]) -> None:
        for event in events:
            if event.kind == "stored":
                seen.update(event.hashes)
            elif event.kind == "removed":
                assert set(event.hashes) <= seen
                seen.difference_update(event.hashes)

    cache.on_events = apply
    fill(cache, 0, 3, "a")

    def block_at(index: int) -> KVBlock:
        if index == 2:
            raise MemoryError("no room for the third block")
        return make_block()

    with pytest.raises(MemoryError):
        cache.insert(cache.hashes(list(range(500, 500 + 3 * BLOCK)), "b"), block_at)
    assert seen == set(cache.keys()) and len(cache) == 3
    fill(cache, 900, 3, "c")
    assert seen == set(cache.keys())


def test_a_running_request_keeps_its_blocks_through_a_flood_even_under_lru():
    """The engine pins a running request's prompt blocks: A's flood cannot evict them until the request ends."""
    engine = LocalEngine(build_model("tiny", seed=0), max_model_len=1024, num_blocks=12, eviction_policy="lru")
    prompt = list(range(3000, 3000 + 4 * 16 + 5))
    chain = engine.prefix_cache.hashes(prompt[: 4 * 16], "salt-b")
    running = engine.stream(prompt, 4, cache_salt="salt-b")
    next(running)  # prefilled: its blocks are cached and in use

    def flood(first: int) -> None:
        for start in range(first, first + 6 * 80, 80):
            engine.generate(list(range(start, start + 80)), 1, cache_salt="salt-a")

    flood(10_000)
    assert all(key in engine.prefix_cache for key in chain) and engine.prefix_cache.evictions > 0
    for _ in running:  # the request ends: its blocks are evictable again
        pass
    flood(20_000)
    assert not any(key in engine.prefix_cache for key in chain)


# --- two real servers: B's next request reports what survived A's flood -------------------------------

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from agentkv.cache_ledger import CacheLedger  # noqa: E402
from agentkv.embedded.server.kv_events import external_hash  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402
from agentkv.tenancy import derive_cache_salt  # noqa: E402

NUM_BLOCKS = 24
HOT = "You are tenant B's careful reviewer; cite the file and line for every claim you make. " * 2


@pytest.fixture(scope="module")
def pair():
    """A fair and an LRU server (tiny model, 24-block pool), each publishing KV events."""
    model = build_model("tiny", seed=0)
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    servers = {policy: LocalServer(LocalEngine(model, model_id=f"tiny-{policy}", max_model_len=1024,
                                               num_blocks=NUM_BLOCKS, eviction_policy=policy),
                                   kv_events_config=config) for policy in ("fair", "lru")}
    with servers["fair"], servers["lru"]:
        yield servers


def chat(server: LocalServer, system: str, user: str, salt: str) -> dict[str, Any]:
    body = {"model": server.model_id, "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": user}],
            "max_tokens": 1, "cache_salt": salt}
    return dict(httpx.post(f"{server.api_base}/chat/completions", json=body, timeout=60).json()["usage"])


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def hot_ids(server: LocalServer) -> list[int]:
    body = {"model": server.model_id, "messages": [{"role": "system", "content": HOT},
                                                   {"role": "user", "content": "Next file."}]}
    return list(httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"])


def flood_and_ask(server: LocalServer) -> tuple[int, int, int]:
    """B's hot prefix, A's flood (more than the pool), B's next turn: (B's cached before, after, ledger's view)."""
    backend = server.backend(kv_events=server.kv_events.endpoint, kv_events_replay=server.kv_events.replay_endpoint)
    with CacheLedger([backend]) as ledger:
        time.sleep(0.2)
        chat(server, HOT, "First file.", "salt-b")
        before = cached(chat(server, HOT, "Second file.", "salt-b"))
        for i in range(8):  # each about 6 blocks of A's own: 48 blocks through a 24-block pool
            chat(server, f"Tenant A's batch job number {i}: summarise every log line below. " * 2, str(i), "salt-a")
        want = {external_hash(key) for key in server.engine.prefix_cache.keys()}
        deadline = time.monotonic() + 10
        while ledger.blocks(backend) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ledger.blocks(backend) == want  # BlockRemoved events named exactly the evicted blocks
        predicted = ledger.resident_tokens(backend, hot_ids(server), "salt-b")
        after = cached(chat(server, HOT, "Next file.", "salt-b"))
        assert server.engine.prefix_cache.evictions > 0 and len(server.engine.prefix_cache) <= NUM_BLOCKS
        assert f'num_gpu_blocks="{NUM_BLOCKS}"' in httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return before, after, predicted


def test_tenant_b_hot_prefix_survives_a_flood_under_fair_and_not_under_lru(pair):
    """Over HTTP with two salts: under fair eviction B's next turn still finds its prefix; under LRU it finds none."""
    fair_before, fair_after, fair_predicted = flood_and_ask(pair["fair"])
    lru_before, lru_after, lru_predicted = flood_and_ask(pair["lru"])
    assert fair_before == lru_before > 0
    assert fair_after == fair_predicted >= fair_before  # fair: B's whole hot prefix is still there
    assert lru_after == lru_predicted == 0  # LRU: A's flood took it


def complete(server: LocalServer, first: int, blocks: int, salt: str) -> None:
    """A token-id prompt of ``blocks`` full blocks and 5 more tokens, sharing nothing with any other."""
    body = {"model": server.model_id, "prompt": list(range(first, first + blocks * 16 + 5)), "max_tokens": 1,
            "cache_salt": salt}
    httpx.post(f"{server.api_base}/completions", json=body, timeout=60).raise_for_status()


def fair_victims(ranking: list[Any], incoming: str, count: int) -> set[Any]:
    """The fair decision applied to the ledger's VRAM-manager view: the blocks ``count`` insertions evict."""
    rank = {block.block_hash: index for index, block in enumerate(ranking)}
    order: dict[Any, list[Any]] = {}
    for block in ranking:
        order.setdefault(block.tenant, []).append(block.block_hash)
    used = {tenant: len(keys) for tenant, keys in order.items()}
    victims = set()
    for _ in range(count):
        candidates = [GroupFacts(tenant, used[tenant], rank[keys[0]]) for tenant, keys in order.items() if keys]
        victim = victim_group("fair", candidates, capacity=NUM_BLOCKS, groups=len(used.keys() | {incoming}),
                              incoming=GroupFacts(incoming, used.get(incoming, 0), 0))
        assert victim is not None
        victims.add(order[victim.group].pop(0))
        used[victim.group] -= 1
        used[incoming] = used.get(incoming, 0) + 1
    return victims


def test_the_ledger_vram_manager_ranking_predicts_what_the_fair_engine_evicts(pair):
    """The fair decision over the ledger's eviction_ranking(as_vram_manager=True) names exactly the blocks the fair
    engine then evicts (seen as BlockRemoved events), and none of them is the under-share tenant's."""
    server = pair["fair"]
    server.engine.reset_prefix_cache()
    acme, globex = derive_cache_salt("eviction-test", "acme"), derive_cache_salt("eviction-test", "globex")
    backend = server.backend(kv_events=server.kv_events.endpoint, kv_events_replay=server.kv_events.replay_endpoint)
    with CacheLedger([backend]) as ledger:
        time.sleep(0.2)

        def in_step() -> set[Any]:
            want = {external_hash(key) for key in server.engine.prefix_cache.keys()}
            deadline = time.monotonic() + 10
            while ledger.blocks(backend) != want and time.monotonic() < deadline:
                time.sleep(0.02)
            assert ledger.blocks(backend) == want
            return want

        complete(server, 100, 5, globex)
        for job in range(4):  # 25 blocks in all: the pool of 24 is full and has evicted once
            complete(server, 1000 * (job + 1), 5, acme)
        before = in_step()
        ranking = ledger.eviction_ranking(backend, as_vram_manager=True)
        predicted = fair_victims(ranking, "acme", 3)
        complete(server, 9000, 3, acme)
        removed = before - in_step()
    globex_blocks = {block.block_hash for block in ranking if block.tenant == "globex"}
    assert len(globex_blocks) == 5 and ranking[0].block_hash in globex_blocks  # LRU would take globex's first
    assert removed == predicted and len(removed) == 3 and not removed & globex_blocks
