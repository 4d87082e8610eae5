"""The embedded server publishes vLLM's KV events: a subscriber written as vLLM's example decodes them unchanged."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
httpx = pytest.importorskip("httpx")

from agentkv.errors import ConfigurationError  # noqa: E402
from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.server.kv_events import KVEventsConfig, external_hash  # noqa: E402
from agentkv.embedded.engine.models import build_model  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402

MODEL_ID = "agentkv-tiny-events"
MESSAGES = [{"role": "system", "content": "You are a careful agent. " * 12}, {"role": "user", "content": "Go."}]


# --- a subscriber written the way vllm/examples/online_serving/kv_events_subscriber.py is -------------
# (its structs carry the fields and options of vllm 0.32's vllm/distributed/kv_events.py: an array batch, tagged map
# events)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class VllmStyleSubscriber:
    """ZMQ SUB on the topic, REQ to the replay endpoint on a sequence gap, msgspec-typed decoding."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.endpoint, self.topic = endpoint, topic
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.replay = self.ctx.socket(zmq.REQ)
        self.replay.connect(replay_endpoint)
        self.last_seq = -1
        self.replays = 0
        self.blocks: dict[int, BlockStored] = {}  # hash -> the event that stored it
        self.parents: dict[int, int | None] = {}
        self.kinds: list[str] = []
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(self.endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)

    def disconnect(self) -> None:
        self.sub.close(linger=0)

    def process(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.kinds.append(type(event).__name__)
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for block_hash in event.block_hashes:
                    self.blocks[block_hash], self.parents[block_hash], parent = event, parent, block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.blocks.pop(block_hash, None)
            else:
                self.blocks.clear()

    def poll_once(self, timeout_ms: int = 50) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        _, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            self.replays += 1
            self.replay.send((self.last_seq + 1).to_bytes(8, "big"))
            while self.replay.poll(timeout=1000):
                _, seq_bytes, replay_payload = self.replay.recv_multipart()  # REQ drops the empty delimiter
                if not replay_payload:
                    break
                replay_seq = int.from_bytes(seq_bytes, "big")
                if replay_seq > self.last_seq and replay_seq < seq:
                    self.process(self.decoder.decode(replay_payload))
                    self.last_seq = replay_seq
        self.process(self.decoder.decode(payload))
        self.last_seq = seq
        return True

    def until(self, done: Any, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self.poll_once()
        assert done(), "the subscriber never caught up with the server's cache"

    def close(self) -> None:
        self.disconnect()
        self.replay.close(linger=0)
        self.ctx.term()


# --- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    engine = LocalEngine(build_model("tiny", seed=0), model_id=MODEL_ID, max_model_len=1024)
    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
              '"replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv-events"}')
    with LocalServer(engine, kv_events_config=config) as running:
        yield running


@pytest.fixture
def subscriber(server):
    sub = VllmStyleSubscriber(server.kv_events.endpoint, server.kv_events.replay_endpoint, "kv-events")
    time.sleep(0.2)  # PUB/SUB's slow joiner: let the subscription reach the publisher
    yield sub
    sub.close()


def chat(server: LocalServer, salt: str) -> dict[str, Any]:
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2, "cache_salt": salt}
    return httpx.post(f"{server.api_base}/chat/completions", json=body, timeout=60).json()


def prompt_ids(server: LocalServer) -> list[int]:
    body = {"model": MODEL_ID, "messages": MESSAGES, "add_generation_prompt": True}
    return list(httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"])


def cache_hashes(server: LocalServer) -> set[int]:
    return {external_hash(key) for key in server.engine.prefix_cache.keys()}


# --- tests --------------------------------------------------------------------------------------------------


def test_config_is_vllms_json():
    """--kv-events-config parses vLLM's JSON with vLLM's defaults, and refuses keys vLLM does not have."""
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.buffer_steps, config.topic) == (
        "zmq", "tcp://*:5557", None, 10_000, "")
    assert KVEventsConfig.from_json("{}").publisher == "null"
    with pytest.raises(ConfigurationError):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')


def test_vllm_subscriber_decodes_our_events_and_they_match_the_cache(server, subscriber):
    """Stores, evictions and a reset decode with vLLM's structs and track the server's own prefix cache exactly."""
    server.engine.reset_prefix_cache()
    subscriber.until(lambda: "AllBlocksCleared" in subscriber.kinds)
    chat(server, "alpha")
    subscriber.until(lambda: set(subscriber.blocks) == cache_hashes(server) != set())

    ids, size = prompt_ids(server), server.engine.block_size
    chain, parent = [], None  # walk the chain from its root through parent links
    while True:
        children = [h for h, p in subscriber.parents.items() if p == parent and h in subscriber.blocks]
        if not children:
            break
        (parent,) = children
        chain.append(parent)
    tokens = []
    for block_hash in chain:
        event = subscriber.blocks[block_hash]
        index = event.block_hashes.index(block_hash)
        tokens += event.token_ids[index * size : (index + 1) * size]
        assert event.extra_keys is not None
        assert event.extra_keys[index] == (("alpha",) if subscriber.parents[block_hash] is None else None)
        assert (event.medium, event.block_size, event.group_idx) == ("GPU", size, 0)
    assert len(chain) == len(subscriber.blocks) and tokens == ids[: len(tokens)] and len(tokens) >= size

    server.engine.prefix_cache.resize(server.engine.prefix_cache.bytes_used // 2)  # evicts the tail
    subscriber.until(lambda: "BlockRemoved" in subscriber.kinds)
    subscriber.until(lambda: set(subscriber.blocks) == cache_hashes(server) != set())
    server.engine.reset_prefix_cache()
    subscriber.until(lambda: subscriber.kinds[-1] == "AllBlocksCleared" and not subscriber.blocks)
    server.engine.prefix_cache.resize(512 << 20)


def test_wire_shape_is_an_array_batch_of_tagged_maps(server):
    """Frames are (topic, 8-byte big-endian seq, msgpack [ts, [{type: ...}], dp_rank]), as vLLM 0.32 publishes."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(server.kv_events.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.2)
    try:
        server.engine.reset_prefix_cache()
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload)
        assert topic == b"kv-events" and len(seq) == 8
        assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
        assert batch[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(linger=0)


def test_replay_replies_are_vllms_four_frames_end_marker_too(server):
    """A DEALER's replay request gets (b"", topic, seq, payload) per batch and (b"", b"", -1, b"") at the end."""
    server.engine.reset_prefix_cache()
    time.sleep(0.2)  # published before the replay request is served
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(server.kv_events.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replies = []
        while dealer.poll(2000):
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        dealer.close(linger=0)
    assert len(replies) >= 2 and all(len(frames) == 4 and frames[0] == b"" for frames in replies)
    assert all(frames[1] == b"kv-events" and len(frames[2]) == 8 and frames[3] for frames in replies[:-1])
    assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert isinstance(msgspec.msgpack.decode(replies[-2][3]), list)


def test_a_gap_is_repaired_through_the_replay_endpoint(server, subscriber):
    """Events missed while disconnected are fetched from the replay endpoint when the next one shows the gap."""
    server.engine.reset_prefix_cache()
    subscriber.until(lambda: subscriber.last_seq >= 0 and "AllBlocksCleared" in subscriber.kinds)
    subscriber.disconnect()
    chat(server, "beta")  # published while nobody listens
    subscriber.connect()
    time.sleep(0.2)
    chat(server, "gamma")
    subscriber.until(lambda: set(subscriber.blocks) == cache_hashes(server) != set())
    assert subscriber.replays >= 1
    salts = {e.extra_keys[0] for e in subscriber.blocks.values() if e.parent_block_hash is None and e.extra_keys}
    assert salts == {("beta",), ("gamma",)}


def test_serve_cli_takes_vllms_flag():
    """`agentkv serve --kv-events-config JSON` builds a server that publishes where the JSON says."""
    import argparse

    from agentkv.embedded.server import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--size", "tiny", "--window", "512", "--port", "0", "--kv-events-config",
                              '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}'])
    built = serve_cli._server(args)
    try:
        assert built.kv_events.endpoint.startswith("tcp://127.0.0.1:") and built.kv_events.replay_endpoint is None
        assert built.engine.prefix_cache.on_events is not None and built.max_model_len == 512
    finally:
        built.stop()
