"""Event-aware warm-ahead and the ledger's predictions, against embedded servers that publish KV events."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.errors import ConfigurationError
from agentkv.warm import CooldownMap, InFlightLimit
from agentkv.warm.events import Residency, decide_event_warm

SYSTEM = "You are a careful agent. Read every file in full before you change anything, and say why. "
POLICY = WarmAheadPolicy(top_up_tokens=256)


# --- the pure decision ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("held, outcome", [(0, "fire"), (700, "fire"), (1000 - 256, "fire"),
                                           (1000 - 255, "skip_resident"), (992, "skip_resident")])
def test_a_claimed_warm_is_skipped_only_when_the_server_holds_all_but_a_short_tail(held, outcome):
    """A claimed warm fires unless the server holds the prompt but for less than top_up_tokens."""
    assert decide_event_warm(Residency(1000, held), claimed=True, policy=POLICY) == outcome


@pytest.mark.parametrize("residency, outcome", [
    (Residency(1000, 992), "cooldown"),                      # nothing warmed by this session
    (Residency(1000, 512, 512, 512), "top_up"),             # resident, tail 488 >= 256
    (Residency(1000, 800, 512, 512), "cooldown"),           # resident, tail 200 < 256
    (Residency(1000, 0, 0, 0), "cooldown"),                 # its warm never showed in the ledger: no baseline
    (Residency(1000, 0, 512, 0), "rewarm_evicted"),         # the warmed prefix is gone
    (Residency(1000, 256, 512, 256), "rewarm_evicted"),     # part of it is gone
])
def test_inside_the_cooldown_only_an_eviction_or_a_long_tail_sends(residency, outcome):
    """Inside the cooldown: re-warm when the warmed prefix lost blocks, top up past top_up_tokens, else nothing."""
    assert decide_event_warm(residency, claimed=False, policy=POLICY) == outcome


def test_top_up_tokens_is_validated():
    """top_up_tokens must be a positive integer."""
    with pytest.raises(ConfigurationError):
        WarmAheadPolicy(top_up_tokens=0)
    assert WarmAheadPolicy().top_up_tokens == 1024


@pytest.mark.parametrize("tenant", ["acme", "acme#event", ""])
def test_no_tenant_can_claim_inside_another_tenants_event_namespace(tenant):
    """A tenant's re-warm/top-up namespace is never a tenant name a Session accepts (acme#event cannot reach acme's)."""
    from agentkv.warm.sender import event_namespace

    namespace = event_namespace(tenant)
    assert namespace not in ("acme", "acme#event", "") and event_namespace(tenant + "x") != namespace
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast", window=2048)
    slow = Backend("hosted_vllm/s", api_base="http://127.0.0.1:9/v1", name="slow", window=16384)
    with pytest.raises(ConfigurationError):
        Session(fast, slow, tenant=namespace, cache_salt_secret="k")


# --- against the servers -------------------------------------------------------------------------------------

pytest.importorskip("torch")
pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def rig():
    """fast (2048-token window) and slow (16384, publishing KV events), and a ledger following slow."""
    from agentkv.cache_ledger import CacheLedger
    from agentkv.embedded.server import LocalServer

    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    fast = LocalServer.from_size("tiny", window=2048, model_id="ev-fast", request_log=10_000)
    slow = LocalServer.from_size("tiny", window=16384, model_id="ev-slow", seed=1, kv_events_config=events,
                                 request_log=10_000)
    with fast, slow:
        backends = (Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base, name="fast"),
                    Backend(f"hosted_vllm/{slow.model_id}", api_base=slow.api_base, name="slow",
                            kv_events=slow.kv_events.endpoint, kv_events_replay=slow.kv_events.replay_endpoint))
        with CacheLedger([backends[1]]) as ledger:
            yield {"fast": fast, "slow": slow, "backends": backends, "ledger": ledger}


def session(rig, tenant, *, policy=POLICY, session_id=None, template=False):
    fast, slow = rig["backends"]
    if template:  # the slow server's tokenizer and chat template declared: ids without /tokenize
        slow = rig["slow"].backend(name="slow", kv_events=slow.kv_events, kv_events_replay=slow.kv_events_replay)
    return Session(fast, slow, tenant=tenant, session_id=session_id or str(uuid.uuid4()), warm_ahead=policy,
                   cache_salt_secret="events-test", discovery=WindowDiscovery(), cooldowns=CooldownMap(),
                   in_flight=InFlightLimit(4), cache_ledger=rig["ledger"])


def turns(n, words=30):
    """A conversation whose first prompt crosses 60% of fast's window and grows by about ``words`` words a turn."""
    messages = [{"role": "system", "content": SYSTEM * 61}, {"role": "user", "content": "Start."}]
    history = [messages]
    for i in range(n):
        messages = messages + [{"role": "assistant", "content": f"Done step {i}."},
                               {"role": "user", "content": f"Step {i}: " + "read the next file carefully " * (words // 5)}]
        history.append(messages)
    return history


def warm_bodies(rig):
    return [r.body for r in rig["slow"].requests if r.path == "/v1/chat/completions" and r.body.get("max_tokens") == 1]


def slow_ids(rig, messages):
    body = {"model": rig["slow"].model_id, "messages": messages, "add_generation_prompt": True}
    return list(httpx.post(f"{rig['slow'].base_url}/tokenize", json=body, timeout=30).json()["tokens"])


def turn(s, messages):
    s.completion(messages=messages, max_tokens=2)
    assert s.drain_warms(60)


@pytest.mark.parametrize("template", [False, True], ids=["tokenize", "template"])
def test_a_warm_is_skipped_when_the_slow_server_already_holds_the_prefix(rig, template):
    """A second session of the same tenant on a prompt the first one warmed skips its warm; another tenant fires."""
    history, a, b = turns(1), f"skip-a-{template}", f"skip-b-{template}"
    first, second, other = (session(rig, tenant, template=template) for tenant in (a, a, b))
    tokenized = sum(r.path == "/tokenize" for r in rig["slow"].requests)
    turn(first, history[1])
    assert first.ledger[-1].warm == "fire"
    assert (first.stats()["warm_fired"], first.stats()["warm_skipped_resident"]) == (1, 0)
    before = len(warm_bodies(rig))
    turn(second, history[1])
    assert (second.stats()["warm_fired"], second.stats()["warm_skipped_resident"]) == (0, 1)
    assert len(warm_bodies(rig)) == before  # nothing was sent
    turn(other, history[1])  # another salt: nothing resident for it
    assert (other.stats()["warm_fired"], other.stats()["warm_skipped_resident"]) == (1, 0)
    assert len(warm_bodies(rig)) == before + 1
    asked = sum(r.path == "/tokenize" for r in rig["slow"].requests) - tokenized
    assert (asked == 0) if template else (asked >= 3)  # each session's check asked slow once, unless declared


def test_an_evicted_warm_is_rewarmed_inside_the_cooldown_and_a_resident_one_is_not(rig):
    """While the warmed prefix is resident, the cooldown holds; once the server drops it, the next turn re-warms."""
    history = turns(3, words=5)
    s = session(rig, "rewarm", policy=WarmAheadPolicy(top_up_tokens=4096))
    turn(s, history[1])
    turn(s, history[2])  # in the cooldown, prefix resident: nothing
    stats = s.stats()
    assert (stats["warm_fired"], stats["warm_rewarm_evicted"], stats["warm_skipped_cooldown"]) == (1, 0, 1)
    rig["slow"].engine.reset_prefix_cache()  # the server drops every block (AllBlocksCleared)
    deadline = time.monotonic() + 10
    while rig["ledger"].blocks(rig["backends"][1]) and time.monotonic() < deadline:
        time.sleep(0.02)
    sent = len(warm_bodies(rig))
    turn(s, history[3])  # still in the cooldown
    stats = s.stats()
    assert (stats["warm_fired"], stats["warm_rewarm_evicted"], stats["warm_skipped_cooldown"]) == (1, 1, 2)
    assert len(warm_bodies(rig)) == sent + 1 and warm_bodies(rig)[-1]["messages"] == history[3]


def test_a_top_up_fires_once_the_unwarmed_tail_passes_top_up_tokens_and_not_before(rig):
    """Each turn in the cooldown tops up exactly when the slow server's cached prefix trails by top_up_tokens."""
    history, policy = turns(7, words=40), WarmAheadPolicy(top_up_tokens=128)
    s = session(rig, "top-up", policy=policy)
    turn(s, history[1])
    assert s.stats()["warm_fired"] == 1
    below = above = 0
    for messages in history[2:]:
        ids = slow_ids(rig, messages)
        tail = len(ids) - rig["ledger"].held_tokens(rig["backends"][1], ids, s._parts.cache_salt)
        topped = s.stats()["warm_top_up"]
        turn(s, messages)
        fired = s.stats()["warm_top_up"] - topped
        assert fired == int(tail >= policy.top_up_tokens), (tail, fired)
        below, above = below + (not fired), above + fired
        if fired:
            assert warm_bodies(rig)[-1]["messages"] == messages
    assert below >= 1 and above >= 2  # both sides were exercised, and a top-up follows a top-up
    assert s.stats()["warm_rewarm_evicted"] == 0


def test_the_async_driver_tops_up_too(rig):
    """acompletion's warms are decided in a task: the same skip and top-up outcomes, over async HTTP."""
    history = turns(7, words=40)

    async def main():
        s = session(rig, "async-top-up")
        for messages in history[1:]:
            await s.acompletion(messages=messages, max_tokens=2)
            await s.adrain_warms(60)
        return s.stats()

    stats = asyncio.run(main())
    assert stats["warm_fired"] == 1 and stats["warm_top_up"] >= 1 and stats["warm_failed"] == 0


def test_the_ledger_predicts_the_cached_tokens_each_slow_request_reports(rig):
    """Requests routed to slow record the ledger's prediction as of the send; it equals the reported cached tokens."""
    history = [[{"role": "system", "content": SYSTEM * 100}, {"role": "user", "content": "Start."}]]
    for i in range(2):
        history.append(history[-1] + [{"role": "assistant", "content": f"ok {i}"},
                                      {"role": "user", "content": f"Next {i}: " + "look again " * 20}])
    s, other = session(rig, "predict-a"), session(rig, "predict-b")
    ledger, slow = rig["ledger"], rig["backends"][1]
    before = next(row for row in ledger.stats() if row.backend == slow.label)
    for messages in history:
        turn(s, messages)
        assert s.last_route.role == "slow"
    turn(other, history[-1])
    stats = s.stats()
    # the ledger's process-wide hit rate counts each prompt's length in slow's tokens, and the cached tokens
    after = next(row for row in ledger.stats() if row.backend == slow.label)
    queried = sum(len(slow_ids(rig, messages)) for messages in history + [history[-1]])
    assert (after.queried_tokens - before.queried_tokens, after.hit_tokens - before.hit_tokens) == (
        queried, stats["cached_tokens_total"])
    assert stats["ledger_predictions"] == 3 == stats["ledger_predictions_exact"]
    assert stats["ledger_predicted_tokens"] == stats["ledger_reported_tokens"] == stats["cached_tokens_total"] > 0
    assert (other.stats()["ledger_predictions_exact"], other.stats()["ledger_reported_tokens"]) == (1, 0)
    # read now instead of as of the send, the ledger also sees the blocks the last request stored itself
    ids = slow_ids(rig, history[-1])
    assert ledger.resident_tokens(rig["backends"][1], ids, s._parts.cache_salt) > s.ledger[-1].cached_tokens


def test_a_streamed_slow_request_is_predicted_when_its_usage_arrives(rig):
    """With a stream, the reported cached tokens come with the last chunk; the prediction still meets them."""
    messages = [{"role": "system", "content": SYSTEM * 100}, {"role": "user", "content": "Stream it."}]
    s = session(rig, "predict-stream")
    for _ in range(2):
        for _chunk in s.completion(messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}):
            pass
        assert s.drain_warms(60) and s.last_route.role == "slow"
    stats = s.stats()
    assert stats["ledger_predictions"] == 2 == stats["ledger_predictions_exact"]
    assert stats["ledger_predicted_tokens"] == stats["ledger_reported_tokens"] == s.ledger[-1].cached_tokens > 0


async def test_the_async_event_aware_path_makes_no_sync_http_call():
    """acompletion with a ledger: the warm's /tokenize to slow and its send are async; a silent ledger leaves the
    decision to the cooldown (one warm, no top-ups)."""
    from test_http_seam import SLOW, Answers, make_session, turns as seam_turns, vllm_like

    from agentkv.cache_ledger import CacheLedger
    from agentkv.testing import FakeHttp

    http = FakeHttp(vllm_like)
    plain = make_session(http, True)
    silent = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", window=16384, kv_events="tcp://127.0.0.1:9")
    with CacheLedger([silent]) as ledger:  # nothing publishes there: the ledger never sees a block
        s = Session(plain.fast, silent, discovery=WindowDiscovery(http=http), http=http, client=Answers(),
                    cooldowns=CooldownMap(), in_flight=InFlightLimit(4), tenant="t", cache_salt_secret="k",
                    warm_ahead=WarmAheadPolicy(top_up_tokens=64), cache_ledger=ledger)
        for messages in seam_turns(30):
            await s.acompletion(messages=messages, max_tokens=8)
            await s.adrain_warms(10)
            if s.last_route.role == "slow":
                break
    stats = s.stats()
    assert s.last_route.role == "slow" and stats["warm_fired"] == 1 and stats["warm_top_up"] == 0
    assert stats["warm_skipped_cooldown"] >= 1 and stats["ledger_predictions"] == 1
    assert any(c.url == f"{SLOW.removesuffix('/v1')}/tokenize" for c in http.calls)
    assert http.blocking_calls == [] and all(c.asynchronous for c in http.calls)


def test_a_stopped_ledger_hands_the_decision_back_to_the_cooldown(rig):
    """Once its ledger stops, a session sends no top-up or re-warm from the stale tree, and predicts nothing."""
    from agentkv.cache_ledger import CacheLedger

    history, policy = turns(7, words=40), WarmAheadPolicy(top_up_tokens=128)
    slow = rig["backends"][1]
    fast = rig["backends"][0]
    ledger = CacheLedger([slow]).start()
    s = Session(fast, slow, tenant="stopped", session_id=str(uuid.uuid4()), warm_ahead=policy,
                cache_salt_secret="events-test", discovery=WindowDiscovery(), cooldowns=CooldownMap(),
                in_flight=InFlightLimit(4), cache_ledger=ledger)
    turn(s, history[1])
    assert s.stats()["warm_fired"] == 1
    ledger.stop()
    for messages in history[2:]:
        turn(s, messages)
    stats = s.stats()
    assert (stats["warm_top_up"], stats["warm_rewarm_evicted"], stats["warm_failed"]) == (0, 0, 0)
    assert stats["warm_skipped_cooldown"] == len(history) - 2
    turn(s, [{"role": "system", "content": SYSTEM * 100}, {"role": "user", "content": "Stale."}])
    assert s.last_route.role == "slow"  # a request to the followed backend, predicted from nothing
    assert (s.stats()["ledger_predictions"], s.stats()["ledger_predictions_unknown"]) == (0, 1)


def test_predictions_hold_when_the_ledger_is_given_another_clock(rig):
    """A ledger with an injected (monotonic) clock still predicts exactly: sends are stamped in the publisher's time."""
    from agentkv.cache_ledger import CacheLedger

    history = [[{"role": "system", "content": SYSTEM * 100}, {"role": "user", "content": "Clock."}]]
    history.append(history[-1] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Again."}])
    fast, slow = rig["backends"]
    with CacheLedger([slow], clock=time.monotonic) as ledger:
        s = Session(fast, slow, tenant="clock", session_id=str(uuid.uuid4()), warm_ahead=POLICY,
                    cache_salt_secret="events-test", discovery=WindowDiscovery(), cooldowns=CooldownMap(),
                    in_flight=InFlightLimit(4), cache_ledger=ledger)
        for messages in history:
            turn(s, messages)
            assert s.last_route.role == "slow"
    stats = s.stats()
    assert stats["ledger_predictions"] == 2 == stats["ledger_predictions_exact"]
    assert stats["ledger_predicted_tokens"] == stats["ledger_reported_tokens"] > 0


def test_a_warm_the_ledger_never_showed_leaves_no_baseline_for_top_ups():
    """A live ledger that stops hearing from the server mid-warm gives no top-up baseline; one that shows the warm does."""
    from agentkv.cache_ledger import CacheLedger
    from agentkv.embedded.server.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
    from agentkv.warm.aware import SlowResidency

    def stored(hashes, parent, tokens, extra):
        return KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, lora_id=None,
            medium="GPU", lora_name=None, extra_keys=extra)])

    publisher = ZmqEventPublisher(endpoint="tcp://127.0.0.1:*")
    backend = Backend("hosted_vllm/s", api_base="http://127.0.0.1:9/v1", name="quiet", kv_events=publisher.endpoint)
    warmed, prompt, policy = list(range(64)), list(range(64)) + [7] * 40, WarmAheadPolicy(top_up_tokens=16)
    try:
        with CacheLedger([backend]) as ledger:
            deadline = time.monotonic() + 10
            while ledger.block_size(backend) is None and time.monotonic() < deadline:  # the SUB joins late
                publisher.publish(stored([1, 2], None, warmed[:32], [("s",), None]))
                time.sleep(0.05)
            residency = SlowResidency(ledger, backend, "s", None, settle_s=0.1)  # type: ignore[arg-type]
            residency.settle(warmed)  # the server went quiet: the ledger shows 32 of the warm's 64 tokens
            assert residency.outcome(prompt, True, claimed=False, policy=policy) == "cooldown"
            publisher.publish(stored([3, 4], 2, warmed[32:], [None, None]))
            residency.settle(warmed)  # now the warm shows in full: a baseline, and the 40-token tail tops up
            assert residency.outcome(prompt, True, claimed=False, policy=policy) == "top_up"
    finally:
        publisher.shutdown()


def test_an_event_aware_warm_broken_by_an_in_place_edit_warns_at_escalation(rig):
    """An agent editing its own system message dict in place after an event-aware warm still gets the broken-warm
    warning when it escalates (the warm job keeps the prompt as it was sent)."""
    import copy

    msgs = copy.deepcopy(turns(1)[1])
    s = session(rig, "in-place")
    turn(s, msgs)
    assert s.stats()["warm_fired"] == 1
    msgs[0]["content"] = SYSTEM * 100  # the same dict the warm was built from: a longer, different system prompt
    turn(s, msgs)
    assert s.last_route.role == "slow" and s.stats()["warm_prefix_broken"] == 1


def test_event_aware_warms_waiting_on_a_silent_ledger_leave_pool_workers_for_other_warms():
    """Many sessions' warms waiting for a live but silent ledger to show them hold at most two of the pool's four
    workers, so another session's plain warm still goes out."""
    from test_http_seam import SLOW, Answers, make_session, turns as seam_turns, vllm_like

    from agentkv.cache_ledger import CacheLedger
    from agentkv.testing import FakeHttp

    http = FakeHttp(vllm_like)
    plain = make_session(http, True)
    silent = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", window=16384, kv_events="tcp://127.0.0.1:9")
    probe = make_session(FakeHttp(vllm_like), True)
    first = next(m for m in seam_turns(30) if (probe.completion(messages=m, max_tokens=8), probe.stats()["warm_fired"])[1])
    with CacheLedger([silent]) as ledger:  # nothing publishes there: no warm ever shows
        sessions = [Session(plain.fast, silent, discovery=WindowDiscovery(http=http), http=http, client=Answers(),
                            cooldowns=CooldownMap(), in_flight=InFlightLimit(4), tenant=f"t{i}",
                            cache_salt_secret="k", cache_ledger=ledger) for i in range(6)]
        for s in sessions:
            s._parts.warm.residency.settle_s = 120.0  # each would hold its worker for two minutes
            s.completion(messages=first, max_tokens=8)
        victim = make_session(http, True)
        victim.completion(messages=first, max_tokens=8)
        assert victim.drain_warms(30) and victim.stats()["warm_completed"] == 1
        deadline = time.monotonic() + 30  # each event-aware warm is counted by its own job, once that job runs
        while sum(s.stats()["warm_fired"] for s in sessions) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(s.stats()["warm_fired"] for s in sessions) == 6
    for s in sessions:  # the stopped ledger ends the waits
        assert s.drain_warms(30)


def test_a_namesake_backend_on_another_server_is_not_followed():
    """The ledger follows a backend by name and server: a Session's slow of the same name elsewhere gets no
    event-aware warms or predictions from the other server's tree."""
    from agentkv.cache_ledger import CacheLedger

    followed = Backend("hosted_vllm/m", api_base="http://10.0.0.1:8000/v1", name="slow", kv_events="tcp://10.0.0.1:5557")
    elsewhere = Backend("hosted_vllm/m", api_base="http://10.0.0.2:8000/v1", name="slow")
    same = Backend("hosted_vllm/m", api_base="http://10.0.0.1:8000/v1/", name="slow")
    ledger = CacheLedger([followed])  # never started: follows() is about configuration
    assert ledger.follows(followed) and ledger.follows(same) and ledger.follows("slow")
    assert not ledger.follows(elsewhere)


def test_a_touched_block_ranks_warmer_whatever_clock_the_ledger_was_given():
    """touch() stamps blocks in the publishers' time, so with an injected (monotonic) ledger clock a block just
    read still ranks warmer than one stored earlier and never read."""
    from agentkv.cache_ledger import CacheLedger
    from agentkv.embedded.server.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    publisher = ZmqEventPublisher(endpoint="tcp://127.0.0.1:*")
    backend = Backend("hosted_vllm/s", api_base="http://127.0.0.1:9/v1", name="ranked", kv_events=publisher.endpoint)
    try:
        with CacheLedger([backend], clock=time.monotonic) as ledger:
            deadline = time.monotonic() + 10
            while len(ledger.blocks(backend)) < 2 and time.monotonic() < deadline:  # the SUB joins late
                for block in (1, 2):  # block 1 stored first, then block 2
                    publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                        block_hashes=[block], parent_block_hash=None, token_ids=[block] * 4, block_size=4, lora_id=None,
                        medium="GPU", lora_name=None, extra_keys=[None])]))
                    time.sleep(0.02)
            assert ledger.touch(backend, [1] * 4, None) == 1  # block 1 is read now
            ranked = ledger.eviction_ranking(backend, as_vram_manager=True)
            assert [block.block_hash for block in ranked] == [2, 1]
    finally:
        publisher.shutdown()
