"""The cache ledger against real vLLM 0.32: endpoints discovered, a late start repaired by replay, /metrics agreed.

Every test here uses ``vllm_slow_alone`` (a slow server no other client talks to: the tier's own in CI, one of its
own beside reused dev servers), since they read its whole event history or its ``/metrics`` deltas. Prompts
carry a uuid, so nothing an earlier run cached is found.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv.cache_ledger import CacheLedger, Subscription
from agentkv.cache_ledger.subscriber import EndpointSubscriber
from agentkv.cache_ledger.tree import BlockTree
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy

pytest.importorskip("zmq")

SENTENCE = "Read every file in full before you change anything, and say why the change is safe. "


def backend(server, **kwargs):
    return Backend(server.litellm_model, api_base=server.base_url, name=server.model, **kwargs)


def conversation(tag, sentences=40):
    return [{"role": "system", "content": f"[{tag}] " + SENTENCE * sentences}, {"role": "user", "content": "Go."}]


def chat(server, messages, salt=None):
    body = {"model": server.model, "messages": messages, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    answer = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    answer.raise_for_status()
    return answer.json()["usage"]


def prompt_ids(server, messages):
    body = {"model": server.model, "messages": messages, "add_generation_prompt": True}
    return list(httpx.post(server.root + "/tokenize", json=body, timeout=30).json()["tokens"])


def quiet(server, timeout_s=60.0):
    """Wait until the server has no request running or waiting (a straggler from an earlier test has landed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(server.root + "/metrics", timeout=10).text
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
        if busy == 0:
            return
        time.sleep(0.2)
    pytest.fail("the slow server never went idle")


def test_discovery_connects_to_the_bound_endpoints_at_the_servers_host(vllm_slow_alone):
    """GET /kv_event_sources names tcp://*:P; the ledger connects to 127.0.0.1:P (the server's host), subscribed to
    vLLM's topic; a Backend declaring tcp://*:P as the server's config writes it is reached the same way."""
    sources = httpx.get(vllm_slow_alone.root + "/kv_event_sources", timeout=10).json()
    assert sources["0"]["endpoint"] == f"tcp://*:{vllm_slow_alone.events_port}"
    ledger = CacheLedger.discover([backend(vllm_slow_alone)])
    assert ledger.subscription(vllm_slow_alone.model) == Subscription(
        vllm_slow_alone.events_endpoint, vllm_slow_alone.replay_endpoint, bind=False, topic="kv-events")
    # the same endpoints copied from the server's config into a Backend are reached at its api_base's host
    copied = backend(vllm_slow_alone, kv_events=sources["0"]["endpoint"], kv_events_replay=sources["0"]["replay_endpoint"])
    assert CacheLedger([copied]).subscription(copied) == Subscription(vllm_slow_alone.events_endpoint,
                                                                       vllm_slow_alone.replay_endpoint)


def test_a_ledger_started_after_traffic_catches_up_through_replay_and_predicts_exactly(vllm_slow_alone):
    """Started after the server stored blocks, the ledger replays the history it missed (to the end marker, with no
    timeout spent) and predicts the cached_tokens the server then reports for the same prompt, to the token."""
    tag, salt = uuid.uuid4().hex, f"late-{uuid.uuid4().hex}"
    messages = conversation(tag)
    assert chat(vllm_slow_alone, messages, salt)["prompt_tokens_details"]["cached_tokens"] == 0
    chat(vllm_slow_alone, conversation(tag + "-other"))
    slow = backend(vllm_slow_alone)
    with CacheLedger.discover([slow]) as ledger:
        (stats,) = ledger.stats()
        ids = prompt_ids(vllm_slow_alone, messages)
        predicted = ledger.resident_tokens(slow, ids, salt)
        usage = chat(vllm_slow_alone, messages, salt)
    assert stats.replayed > 0 and stats.unrepaired == 0 and stats.errors == 0
    assert (stats.replays, stats.replay_timeouts) == (1, 0)  # the end marker ended the replay
    assert len(ids) == usage["prompt_tokens"]
    assert predicted == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert ledger.resident_tokens(slow, ids, f"another-{salt}") == 0


def replay_frames(server):
    """Every buffered batch as it was published, (topic, seq, payload), read from the replay endpoint."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(server.replay_endpoint)
    messages = []
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while dealer.poll(10_000):
            _, topic, seq, payload = dealer.recv_multipart()
            if not payload:
                return messages
            messages.append([topic, seq, payload])
    finally:
        dealer.close(linger=0)
    pytest.fail("the replay never sent its end marker")


def test_a_gap_in_the_live_stream_is_repaired_from_vllms_replay(vllm_slow_alone):
    """A message missed between two others is fetched through vLLM's replay and applied before the next: the gap is
    repaired (nothing unrepaired) and the replay ends at its end marker (no timeout)."""
    for n in range(3):
        chat(vllm_slow_alone, conversation(f"{uuid.uuid4().hex}-gap-{n}"))
    messages = replay_frames(vllm_slow_alone)[-3:]
    assert len(messages) == 3
    follower = EndpointSubscriber("slow", vllm_slow_alone.events_endpoint, vllm_slow_alone.replay_endpoint, BlockTree(),
                                  threading.Lock(), replay_timeout_s=10.0)
    replay = follower._replay_socket()
    assert replay is not None
    try:
        follower.last_seq = int.from_bytes(messages[0][1], "big") - 1
        follower.handle(messages[0], replay)
        follower.handle(messages[2], replay)  # messages[1] never arrived live
    finally:
        replay.close(linger=0)
    assert (follower.gaps, follower.replayed, follower.unrepaired) == (1, 1, 0)
    assert (follower.replays, follower.replay_timeouts, follower.errors) == (1, 0, 0)
    assert follower.last_seq == int.from_bytes(messages[2][1], "big") and follower.batches == 3


def test_a_sessions_ledger_agrees_with_the_servers_metrics_warms_included(vllm_fast, vllm_slow_alone):
    """A Session with a ledger, over a conversation that warms slow ahead and escalates to it: the ledger's tokens
    queried and hit (its requests and its warms) match slow's /metrics over the same window, within 1%."""
    fast, slow = backend(vllm_fast), backend(vllm_slow_alone)
    quiet(vllm_slow_alone)
    with CacheLedger.discover([fast, slow]) as ledger:
        assert ledger.backends == [slow.label]
        s = Session(fast, slow, tenant="ledger-tier", cache_salt_secret="ledger-tier-secret", count_exactly=True,
                    warm_ahead=WarmAheadPolicy(), discovery=WindowDiscovery(), cooldowns=CooldownMap(),
                    in_flight=InFlightLimit(4), cache_ledger=ledger)
        assert ledger.cross_check(slow) is None  # opens the window
        # about 1,280 tokens (over 60% of fast's 2,048: the warm fires at once), then about 290 more a turn
        messages, roles = conversation(uuid.uuid4().hex, sentences=62), []
        while roles.count("slow") < 2 and len(roles) < 8:
            s.completion(messages=messages, max_tokens=4)
            assert s.drain_warms(120)
            roles.append(s.last_route.role)
            messages = messages + [{"role": "assistant", "content": "Done."},
                                   {"role": "user", "content": "Next: " + SENTENCE * 14}]
        check = ledger.cross_check(slow)
    stats = s.stats()
    assert roles.count("slow") == 2 and stats["warm_completed"] >= 1, (roles, stats)
    assert check is not None and not check.reset and check.server.queries > 0 and check.server.hits > 0
    assert abs(check.unrecorded_queries) <= 0.01 * check.server.queries, check
    assert check.gap is not None and abs(check.gap) <= 0.01, check
