"""CacheLedger: the embedded server's resident blocks, rebuilt from its KV events, predict what requests find."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

from agentkv import Backend  # noqa: E402
from agentkv.errors import ConfigurationError  # noqa: E402
from agentkv.cache_ledger import BlockTree, CacheLedger, TenantScopeError  # noqa: E402
from agentkv.cache_ledger.subscriber import EndpointSubscriber  # noqa: E402
from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.server.kv_events import external_hash  # noqa: E402
from agentkv.embedded.engine.models import build_model  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402
from agentkv.tenancy import derive_cache_salt  # noqa: E402

MODEL_ID = "agentkv-tiny-ledger"
SECRET = "ledger-test-secret"
SYSTEM = "You are a careful agent that reads the whole file before acting. "


@pytest.fixture(scope="module")
def server():
    engine = LocalEngine(build_model("tiny", seed=0), model_id=MODEL_ID, max_model_len=1024)
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    with LocalServer(engine, kv_events_config=config) as running:
        yield running


@pytest.fixture
def backend(server):
    server.engine.reset_prefix_cache()
    return server.backend(kv_events=server.kv_events.endpoint, kv_events_replay=server.kv_events.replay_endpoint)


def messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM * 8}, {"role": "user", "content": user}]


def prompt_ids(server: LocalServer, user: str) -> list[int]:
    body = {"model": MODEL_ID, "messages": messages(user), "add_generation_prompt": True}
    return list(httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"])


def cached_tokens(server: LocalServer, user: str, salt: str) -> int:
    body = {"model": MODEL_ID, "messages": messages(user), "max_tokens": 1, "cache_salt": salt}
    usage = httpx.post(f"{server.api_base}/chat/completions", json=body, timeout=60).json()["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def in_step(ledger: CacheLedger, backend: Any, server: LocalServer, timeout_s: float = 10.0) -> None:
    """Wait until the ledger holds exactly the server's blocks (it follows asynchronously)."""
    want = {external_hash(key) for key in server.engine.prefix_cache.keys()}
    deadline = time.monotonic() + timeout_s
    while ledger.blocks(backend) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ledger.blocks(backend) == want


def test_predicted_resident_tokens_equal_the_cached_tokens_the_server_reports(server, backend):
    """For the same salt the ledger predicts exactly the server's cached_tokens; for another tenant's salt, 0."""
    acme, globex = derive_cache_salt(SECRET, "acme"), derive_cache_salt(SECRET, "globex")
    with CacheLedger([backend]) as ledger:
        time.sleep(0.2)
        assert cached_tokens(server, "Read main.py.", acme) == 0
        in_step(ledger, backend, server)
        follow_up = prompt_ids(server, "Now read utils.py and compare.")
        predicted = ledger.resident_tokens(backend, follow_up, acme)
        assert predicted > 0 and ledger.resident_tokens(backend, follow_up, globex) == 0
        actual = cached_tokens(server, "Now read utils.py and compare.", acme)
        ledger.record(backend, predicted, actual)
        assert actual == predicted
        assert cached_tokens(server, "Now read utils.py and compare.", globex) == 0
        assert ledger.held_tokens(backend, follow_up, acme) >= predicted
        (stats,) = ledger.stats()
        assert (stats.predictions, stats.exact_predictions, stats.cached_tokens) == (1, 1, actual)
        in_step(ledger, backend, server)
        again = prompt_ids(server, "Now read utils.py and compare.")
        assert ledger.resident_tokens(backend, again, acme) == cached_tokens(server, "Now read utils.py and compare.",
                                                                             acme) > predicted


def test_a_late_ledger_catches_up_through_replay(server, backend):
    """A ledger started after the server published rebuilds the history it missed from the replay endpoint."""
    salt = derive_cache_salt(SECRET, "acme")
    cached_tokens(server, "Summarise the repository.", salt)
    time.sleep(0.2)  # published before the ledger exists: only the replay buffer has it
    with CacheLedger([backend]) as ledger:
        in_step(ledger, backend, server)  # with no further traffic
        (stats,) = ledger.stats()
        assert stats.replayed >= 1 and stats.unrepaired == 0 and stats.blocks > 0
        ids = prompt_ids(server, "Summarise the repository.")
        assert ledger.resident_tokens(backend, ids, salt) == cached_tokens(server, "Summarise the repository.", salt) > 0


def test_a_mid_stream_gap_is_repaired_and_a_clear_resets(server, backend):
    """A message lost between two others is fetched from the replay endpoint; AllBlocksCleared empties the tree."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(server.kv_events.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    time.sleep(0.2)
    frames = []
    try:
        for user in ("one", "two", "three"):
            cached_tokens(server, user, derive_cache_salt(SECRET, "acme"))
        while sub.poll(500):
            frames.append(sub.recv_multipart())
    finally:
        sub.close(linger=0)
    tree, lock = BlockTree(), threading.Lock()
    follower = EndpointSubscriber("t", server.kv_events.endpoint, server.kv_events.replay_endpoint, tree, lock)
    replay = follower._replay_socket()
    try:
        follower.last_seq = int.from_bytes(frames[0][1], "big") - 1
        assert len(frames) >= 3
        for index, message in enumerate(frames):
            if index != 1:  # frames[1] never arrived
                follower.handle(message, replay)
    finally:
        assert replay is not None
        replay.close(linger=0)
    assert (follower.gaps, follower.replayed, follower.unrepaired) == (1, 1, 0)
    assert set(tree.blocks) == {external_hash(key) for key in server.engine.prefix_cache.keys()}
    resets = tree.resets
    tree.apply([{"type": "AllBlocksCleared"}], now=0.0)
    assert len(tree) == 0 and tree.resets == resets + 1


def test_eviction_ranking_is_tenant_scoped_and_fails_closed(server, backend):
    """No tenant: refused unless the VRAM manager asks; a tenant sees only its own blocks, coldest first."""
    acme, globex = derive_cache_salt(SECRET, "acme"), derive_cache_salt(SECRET, "globex")
    with CacheLedger([backend]) as ledger:
        time.sleep(0.2)
        cached_tokens(server, "acme's first task", acme)
        cached_tokens(server, "globex's task", globex)
        cached_tokens(server, "a stranger's task", "a-salt-no-tenant-was-derived-for")
        in_step(ledger, backend, server)
        with pytest.raises(TenantScopeError):
            ledger.eviction_ranking(backend)
        everyone = ledger.eviction_ranking(backend, as_vram_manager=True)
        assert {block.tenant for block in everyone} == {"acme", "globex", None}
        ledger.touch(backend, prompt_ids(server, "acme's first task")[:32], acme)  # acme's head is now the warmest
        ranked = ledger.eviction_ranking(backend, tenant="acme")
        assert ranked and {block.tenant for block in ranked} == {"acme"}
        assert [block.last_used for block in ranked] == sorted(block.last_used for block in ranked)
        assert ranked[-1].depth <= 1 and ranked[0].depth > 1
        assert ledger.eviction_ranking(backend, tenant="nobody") == []


def test_a_replayed_duplicate_is_ignored_and_a_restart_resets():
    """An old seq with an old clock is a duplicate; an old seq with a newer clock is a restarted server."""
    import msgspec

    from agentkv.embedded.server.kv_events import BlockStored, KVEventBatch

    def frame(seq: int, ts: float, block: int) -> list[bytes]:
        stored = BlockStored(block_hashes=[block], parent_block_hash=None, token_ids=[block, block], block_size=2,
                             lora_id=None, medium="GPU", lora_name=None, extra_keys=[None])
        return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(KVEventBatch(ts=ts, events=[stored]))]

    tree = BlockTree()
    follower = EndpointSubscriber("t", "tcp://127.0.0.1:1", None, tree, threading.Lock())
    for seq in range(3):
        follower.handle(frame(seq, 10.0 + seq, 100 + seq), None)
    follower.handle(frame(1, 11.0, 999), None)  # the same batch again
    assert set(tree.blocks) == {100, 101, 102} and tree.resets == 0
    follower.handle(frame(0, 50.0, 7), None)  # the server came back
    assert set(tree.blocks) == {7} and tree.resets == 1 and follower.last_seq == 0


def test_the_tree_is_bounded():
    """Past max_blocks the coldest blocks are forgotten, so memory stays bounded under any stream."""
    tree = BlockTree(max_blocks=10)
    for n in range(30):
        tree.apply([{"type": "BlockStored", "block_hashes": [n], "parent_block_hash": None, "token_ids": [n, n],
                     "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}], now=float(n))
    assert len(tree) <= 10 and tree.forgotten >= 20
    assert tree.resident_tokens([29, 29, 0], None) == 2 and tree.resident_tokens([0, 0, 0], None) == 0


def test_the_legacy_array_layout_is_read_too():
    """Events from a vLLM before #42892 (tagged arrays, fields in declaration order) build the same tree."""
    tree = BlockTree()
    tree.apply([["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU", None, [("s",), None]]], now=1.0)
    assert tree.resident_tokens([1, 2, 3, 4, 9], "s") == 4 and tree.resident_tokens([1, 2, 3, 4, 9], "t") == 0
    tree.apply([["BlockRemoved", [8], "GPU"]], now=2.0)
    assert tree.resident_tokens([1, 2, 3, 4, 9], "s") == 2


def test_backend_kv_events_must_be_zmq_addresses():
    """A Backend's kv_events endpoint is a ZMQ address; anything else is a configuration error."""
    with pytest.raises(ConfigurationError):
        Backend("hosted_vllm/x", kv_events="http://127.0.0.1:5557")
    assert Backend("hosted_vllm/x", kv_events="tcp://127.0.0.1:5557").kv_events == "tcp://127.0.0.1:5557"
