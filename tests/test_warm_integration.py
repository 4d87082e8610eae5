"""Warm-ahead against the embedded servers: firing, hits, guards, tenants and prefix diagnostics."""

import copy

from agentkv import Backend, Session
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.testing import FakeClock, capture_events
from agentkv.warm import CooldownMap
from conftest import chat_requests

TOOLS8 = TOOLS[:8]


def make_session(fresh, slow=None, **kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = slow or Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    kwargs.setdefault("session_id", fresh["session_id"])
    kwargs.setdefault("cooldowns", fresh["cooldowns"])
    return Session(fast, slow, discovery=fresh["discovery"], in_flight=fresh["in_flight"], **kwargs)


def warms(server):
    return [b for b in chat_requests(server) if b.get("max_tokens") == 1]


def grow(turns):
    return ScriptedAgent(result_rows=1).conversation(turns)


def test_crossing_sixty_percent_fires_exactly_one_warm(fresh):
    """Crossing 60% sends one max_tokens=1 request to slow with the same messages and tools; later turns do not."""
    history = grow(6)
    with make_session(fresh) as s:
        for msgs in history[:6]:
            s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
        assert s.drain_warms(30)
    sent = warms(fresh["slow"])
    assert len(sent) == 1 and s.stats()["warm_fired"] == 1
    crossing = next(e for e in s.ledger if e.warm == "fire")
    assert crossing.input_tokens >= 0.6 * 2048
    assert sent[0]["messages"] == history[crossing.turn - 1] and sent[0]["tools"] == TOOLS8
    assert s.stats()["warm_skipped_cooldown"] == 6 - crossing.turn


def test_cooldown_expires_on_the_fake_clock(fresh):
    """Inside five minutes a second crossing fires nothing; after them it fires again."""
    clock = FakeClock()
    history = grow(5)
    with make_session(fresh, cooldowns=CooldownMap(timer=clock)) as s:
        s.completion(messages=history[4], tools=TOOLS8, max_tokens=2)
        clock.advance(299)
        s.completion(messages=history[5], tools=TOOLS8, max_tokens=2)
        assert s.stats()["warm_fired"] == 1
        clock.advance(2)
        s.completion(messages=history[5], tools=TOOLS8, max_tokens=2)
        assert s.drain_warms(30)
    assert s.stats()["warm_fired"] == 2 and len(warms(fresh["slow"])) == 2


def test_escalation_hits_the_warmed_prefix(fresh):
    """The escalated request reports cached tokens of at least 80% of the warmed prefix."""
    history = grow(9)
    with make_session(fresh, tenant="hits", cache_salt_secret="k") as s:
        for msgs in history:
            s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
            s.drain_warms(30)
            if s.last_route.role == "slow":
                break
    warmed = next(e for e in s.ledger if e.warm == "fire").input_tokens
    escalated = s.ledger[-1]
    assert escalated.reason == "proactive" and escalated.cached_tokens >= 0.8 * warmed
    assert s.drain_warms(30)  # the warm-prefix check runs off the request path
    assert s.stats()["escalations_after_warm"] == 1 and s.stats()["cached_tokens_on_escalation"] >= 0.8 * warmed
    assert s.stats()["warm_prefix_broken"] == 0


def test_warm_and_real_request_carry_the_same_salt(fresh):
    """The warm's cache_salt equals the escalated request's, so they share blocks."""
    history = grow(9)
    with make_session(fresh, tenant="salty", cache_salt_secret="k") as s:
        s.completion(messages=history[4], tools=TOOLS8, max_tokens=2)
        s.drain_warms(30)
        s.completion(messages=history[9], tools=TOOLS8, max_tokens=2)
    warm, real = chat_requests(fresh["slow"])
    assert warm["max_tokens"] == 1 and real["max_tokens"] == 2
    assert warm["cache_salt"] == real["cache_salt"] == s._parts.cache_salt


def test_env_switch_disables_warm_at_call_time(fresh, monkeypatch):
    """AGENTKV_WARM_AHEAD=0 stops warms without a restart, and counts the skip."""
    history = grow(4)
    with make_session(fresh) as s:
        monkeypatch.setenv("AGENTKV_WARM_AHEAD", "0")
        s.completion(messages=history[4], tools=TOOLS8, max_tokens=2)
    assert warms(fresh["slow"]) == [] and s.stats()["warm_skipped_disabled"] == 1


def test_unknown_served_model_skips_warm(fresh):
    """A slow backend whose model the server does not list gets no warm."""
    ghost = Backend("hosted_vllm/not-served", api_base=fresh["slow"].api_base, name="slow")
    history = grow(4)
    with make_session(fresh, slow=ghost) as s:
        s.completion(messages=history[4], tools=TOOLS8, max_tokens=2)
    assert warms(fresh["slow"]) == [] and s.stats()["warm_skipped_unknown_model"] == 1


def test_slow_down_leaves_turns_unaffected_and_counts_failure(fresh):
    """A slow server that dies after discovery leaves the user's turns answered and counts the failed warm."""
    from agentkv.embedded.server import LocalServer

    doomed = LocalServer.from_size("tiny", window=16384, model_id="doomed").start()
    slow = Backend("hosted_vllm/doomed", api_base=doomed.api_base, name="slow")
    history = grow(4)
    with make_session(fresh, slow=slow) as s:
        assert s._parts.discovery.served_model_known(slow)
        doomed.stop()
        resp = s.completion(messages=history[4], tools=TOOLS8, max_tokens=2)
        assert resp.choices and s.last_route.backend == "fast"
        assert s.drain_warms(60)
    assert s.stats()["warm_fired"] == 1 and s.stats()["warm_failed"] == 1


def test_tenants_do_not_share_warmed_blocks(fresh):
    """Tenant B's identical conversation gets zero cached tokens from tenant A's warm."""
    history = grow(9)
    unique = [{"role": "system", "content": "tenant isolation probe " + fresh["session_id"]}] + history[9][1:]
    with make_session(fresh, tenant="a", cache_salt_secret="k", session_id="sa") as a:
        a.completion(messages=unique[:9], tools=TOOLS8, max_tokens=2)
        assert a.drain_warms(30) and a.stats()["warm_fired"] == 1
    with make_session(fresh, tenant="b", cache_salt_secret="k", session_id="sb") as b:
        b.completion(messages=unique, tools=TOOLS8, max_tokens=2)
    assert b.last_route.role == "slow" and b.ledger[-1].cached_tokens == 0


def test_prefix_report_finds_timestamp_and_tool_reorder(fresh):
    """The report names a changed timestamp in the system prompt and a reordered tool list."""
    history = grow(2)
    stamped = [dict(m) for m in history[2]]
    stamped[0] = {"role": "system", "content": "Now: 2026-11-30 10:00:00. " + stamped[0]["content"]}
    later = [dict(m) for m in stamped]
    later[0] = {"role": "system", "content": "Now: 2026-11-30 10:05:00. " + stamped[0]["content"][26:]}
    with make_session(fresh) as s:
        s.completion(messages=history[1], tools=TOOLS8, max_tokens=2)
        s.completion(messages=history[2], tools=TOOLS8, max_tokens=2)
        intact = s.prefix_report()
        s.completion(messages=stamped, tools=TOOLS8, max_tokens=2)
        s.completion(messages=later, tools=TOOLS8, max_tokens=2)
        stamp = s.prefix_report()
        s.completion(messages=later, tools=list(reversed(TOOLS8)), max_tokens=2)
        reorder = s.prefix_report()
    assert intact.intact and intact.reusable_tokens == intact.previous_tokens and intact.exact
    assert stamp.divergence_message == 0 and "timestamp" in stamp.reason and stamp.reusable_blocks < 2
    assert reorder.reason == "tools reordered" and not reorder.intact


def test_broken_warm_prefix_warns_at_escalation(fresh):
    """Changing the system prompt after a warm logs a warning when the escalation comes."""
    history = grow(9)
    with make_session(fresh) as s:
        s.completion(messages=history[4], tools=TOOLS8, max_tokens=2)
        s.drain_warms(30)
        changed = [{"role": "system", "content": "A different system prompt."}] + history[9][1:]
        with capture_events() as events:
            s.completion(messages=changed, tools=TOOLS8, max_tokens=2)
            assert s.drain_warms(30)  # the check runs off the request path
    assert s.stats()["warm_prefix_broken"] == 1
    assert any(e["event"] == "warm_prefix_broken" and e["log_level"] == "warning" for e in events)


def test_a_warm_prefix_broken_by_an_in_place_edit_warns_at_escalation(fresh):
    """An agent that edits its own system message dict in place after a warm still gets the broken-warm
    warning when it escalates (the warmed prompt is kept as it was sent)."""
    history = grow(9)
    msgs = copy.deepcopy(history[4])
    with make_session(fresh) as s:
        s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
        s.drain_warms(30)
        msgs[0]["content"] = "A different system prompt."  # the same dict the warm was built from
        msgs += copy.deepcopy(history[9][len(msgs):])
        s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
        assert s.drain_warms(30)
    assert s.stats()["warm_fired"] == 1 and s.stats()["warm_prefix_broken"] == 1


async def test_async_warm_is_a_task(fresh):
    """acompletion fires the warm as an asyncio task and returns without waiting for it."""
    history = grow(4)
    async with make_session(fresh) as s:
        await s.acompletion(messages=history[4], tools=TOOLS8, max_tokens=2)
        await s.adrain_warms(30)
    assert s.stats()["warm_fired"] == 1 and s.stats()["warm_completed"] == 1 and len(warms(fresh["slow"])) == 1
