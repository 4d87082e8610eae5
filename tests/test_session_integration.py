"""The Session end to end: real litellm over real HTTP to embedded vLLM-compatible servers."""

import copy

import pytest

from agentkv import Backend, ContextOverflowError, Session, WindowDiscovery
from agentkv.http.transport import HttpError
from agentkv.testing import FakeHttp
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.testing import FakeClock, capture_events
from agentkv.tokens import TemplateSource, TokenCount, TokenCounter
from conftest import chat_requests


def backends(fresh, **fast_kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast", **fast_kwargs)
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return fast, slow


def session(fresh, fast=None, slow=None, **kwargs):
    f, s = backends(fresh)
    kwargs.setdefault("session_id", fresh["session_id"])
    return Session(fast or f, slow or s, discovery=kwargs.pop("discovery", fresh["discovery"]),
                   cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"], **kwargs)


def conversation(turns, rows=1, tools=8):
    agent = ScriptedAgent(result_rows=rows)
    msgs = agent.opening()
    for _ in range(turns):
        msgs += agent.next_turn()
    return msgs, TOOLS[:tools]


def test_small_turn_goes_to_fast(fresh):
    """A turn that fits is answered by fast, with its window discovered from the server."""
    msgs, tools = conversation(0)
    with session(fresh) as s:
        resp = s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert s.last_route.backend == "fast" and s.last_route.reason == "fits" and s.last_route.window == 2048
    assert resp.choices[0].message is not None
    assert len(chat_requests(fresh["fast"])) == 1 and chat_requests(fresh["slow"]) == []


def test_over_window_goes_straight_to_slow(fresh):
    """A conversation over the fast window goes to slow with zero requests to fast."""
    msgs, tools = conversation(8)
    with session(fresh) as s:
        s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert (s.last_route.backend, s.last_route.reason) == ("slow", "proactive")
    assert chat_requests(fresh["fast"]) == []
    assert s.stats()["requests"] == {"slow": 1} and s.stats()["proactive_routes"] == 1


def test_backend_receives_exactly_what_the_caller_passed(fresh):
    """Messages and tools arrive whole and in order, and the caller's list is not mutated."""
    msgs, tools = conversation(3)
    before = copy.deepcopy(msgs)
    with session(fresh) as s:
        s.completion(messages=msgs, tools=tools, max_tokens=4, temperature=0)
    body = chat_requests(fresh["fast"])[0]
    assert msgs == before
    assert [m["role"] for m in body["messages"]] == [m["role"] for m in msgs]
    assert [m.get("content") for m in body["messages"]] == [m.get("content") for m in msgs]
    assert body["tools"] == tools


def test_clamp_before_sending(fresh):
    """An input that fits with a too-large max_tokens is clamped to what fits and answered by fast."""
    msgs, tools = conversation(6)
    with session(fresh) as s:
        s.completion(messages=msgs, tools=tools, max_tokens=600)
    decision = s.last_route
    assert decision.reason == "clamped" and decision.backend == "fast"
    assert decision.max_tokens == 2048 - decision.estimated_input_tokens
    assert chat_requests(fresh["fast"])[0]["max_tokens"] == decision.max_tokens


def test_wrong_window_is_caught_by_reactive_clamp(fresh):
    """A declared window larger than the server's gets the 400 for max_tokens over it, is clamped with an exact count,
    and succeeds."""
    fast, slow = backends(fresh, window=8192)
    msgs, tools = conversation(6)
    with capture_events() as events, session(fresh, fast=fast, slow=slow) as s:
        resp = s.completion(messages=msgs, tools=tools, max_tokens=4096)
    assert resp.choices and s.last_route.reason == "reactive_clamp" and s.last_route.backend == "fast"
    assert s.last_route.max_tokens == 2048 - s.last_route.estimated_input_tokens
    assert [b["max_tokens"] for b in chat_requests(fresh["fast"])][-1] == s.last_route.max_tokens
    assert s.stats()["reactive_clamps"] == 1 and s.stats()["overflow_errors"] == 1
    assert any(e["event"] == "overflow" and e["variant"] == "max_tokens_over_window" for e in events)


def test_wrong_window_the_server_clamps_silently_is_recorded_and_rediscovered(fresh):
    """As vLLM 0.32, the server cuts prompt + max_tokens over its window without a 400: the Session records the
    server clamp, and the next request is routed and clamped with the server's real window."""
    fast, slow = backends(fresh, window=8192)
    msgs, tools = conversation(6)
    with session(fresh, fast=fast, slow=slow) as s:
        first = s.completion(messages=msgs, tools=tools, max_tokens=600)
        assert first.choices and s.stats()["server_clamps"] == 1 and s.stats()["overflow_errors"] == 0
        s.completion(messages=msgs, tools=tools, max_tokens=600)
    assert (s.last_route.backend, s.last_route.reason, s.last_route.window) == ("fast", "clamped", 2048)
    assert chat_requests(fresh["fast"])[-1]["max_tokens"] == 2048 - s.last_route.estimated_input_tokens


class UnderCount:
    """A token source that is 30% low, for both routing and clamping: the worst case for the reactive path."""

    name = "under"

    def count(self, payload):
        exact = TemplateSource("cl100k_base").count(payload)
        low = int(exact.total * 0.7)
        return TokenCount(low, low, exact.tools, self.name, False)


def test_under_estimate_is_caught_by_reactive_escalation(fresh):
    """A count that is wrong low sends a too-long prompt to fast; its 400 is answered by slow."""
    msgs, tools = conversation(9)
    with session(fresh) as s:
        s._parts.counters["fast"] = TokenCounter([UnderCount()])
        resp = s.completion(messages=msgs, tools=tools, max_tokens=8)
    assert resp.choices and (s.last_route.backend, s.last_route.reason) == ("slow", "reactive_escalate")
    real = [b for b in chat_requests(fresh["slow"]) if b.get("max_tokens") != 1]  # max_tokens=1: a warm
    assert len(chat_requests(fresh["fast"])) == 1 and len(real) == 1
    assert s.stats()["reactive_escalations"] == 1


def test_request_too_big_for_both_raises_and_sends_nothing(fresh):
    """A request that fits neither window raises ContextOverflowError naming both, and sends nothing."""
    fresh["slow"].max_model_len = 2500
    msgs, tools = conversation(12)
    with session(fresh) as s, pytest.raises(ContextOverflowError) as info:
        s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert "2048" in str(info.value) and "2500" in str(info.value)
    assert chat_requests(fresh["fast"]) == chat_requests(fresh["slow"]) == []


def test_window_change_is_picked_up_after_ttl(fresh):
    """A swap slot that changes the window is seen after the 15-minute TTL, not before."""
    clock = FakeClock()
    discovery = WindowDiscovery(timer=clock)
    msgs, tools = conversation(8)
    with session(fresh, discovery=discovery) as s:
        s.completion(messages=msgs, tools=tools, max_tokens=4)
        assert s.last_route.backend == "slow"
        fresh["fast"].max_model_len = 8192
        clock.advance(899)
        s.completion(messages=msgs, tools=tools, max_tokens=4)
        assert s.last_route.backend == "slow"
        clock.advance(2)
        with capture_events() as events:
            s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert s.last_route.backend == "fast" and s.last_route.window == 8192
    assert any(e["event"] == "window_changed" for e in events)


def test_discovery_failure_does_not_break_the_request(fresh):
    """With /models unreachable the request still goes out and is answered."""
    def broken(method, url, body):
        raise HttpError("ConnectError from /v1/models")

    msgs, tools = conversation(0)
    with capture_events() as events, session(fresh, discovery=WindowDiscovery(http=FakeHttp(broken))) as s:
        resp = s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert resp.choices and s.last_route.backend == "fast" and s.last_route.window is None
    assert any(e["event"] == "discovery_failed" for e in events)


def test_slow_server_down_does_not_affect_fast_turns(fresh):
    """A slow backend that is down during discovery leaves fitting turns untouched."""
    fast, _ = backends(fresh)
    dead = Backend("hosted_vllm/slow-tiny", api_base="http://127.0.0.1:9/v1", name="slow")
    msgs, tools = conversation(0)
    with session(fresh, fast=fast, slow=dead) as s:
        resp = s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert resp.choices and s.last_route.backend == "fast"


def test_cache_salt_is_sent_to_self_hosted_backends(fresh):
    """A tenant with a salt secret sends HMAC(secret, tenant) as cache_salt in the body."""
    from agentkv.tenancy import derive_cache_salt

    msgs, tools = conversation(0)
    with session(fresh, tenant="acme", cache_salt_secret="k") as s:
        s.completion(messages=msgs, tools=tools, max_tokens=4)
    assert chat_requests(fresh["fast"])[0]["cache_salt"] == derive_cache_salt("k", "acme")


def test_ledger_records_each_turn(fresh):
    """Each request adds a ledger row with its tokens, tool share, count source (exact when asked for) and cached tokens."""
    msgs, tools = conversation(0)
    with session(fresh, count_exactly=True) as s:
        s.completion(messages=msgs, tools=tools, max_tokens=4)
        s.completion(messages=msgs, tools=tools, max_tokens=4)
    first, second = s.ledger
    assert first.count_source == "server" and first.count_kind == "exact" and first.tool_tokens > 600
    assert second.cached_tokens and second.cached_tokens >= first.input_tokens - 16


def test_a_bounded_ledger_keeps_its_latest_rows_and_their_turn_numbers(fresh):
    """``ledger_rows=3``: five turns leave rows 3 to 5, each with its cached tokens; usage for a turn still held is
    recorded, one already dropped is refused by name."""
    msgs, tools = conversation(0)
    with session(fresh, ledger_rows=3) as s:
        for _ in range(5):
            s.completion(messages=msgs, tools=tools, max_tokens=4)
        s.record_usage(4, cached_tokens=7)
        with pytest.raises(ValueError, match="turns 3 to 5"):
            s.record_usage(2, cached_tokens=1)
    assert [row.turn for row in s.ledger] == [3, 4, 5] and s.ledger[1].cached_tokens == 7
    assert s.ledger[2].cached_tokens and s.stats()["requests_total"] == 5


@pytest.mark.parametrize("rows", [0, -1, 2.5, True])
def test_a_ledger_bound_that_is_no_positive_int_is_refused(fresh, rows):
    with pytest.raises(ValueError, match="ledger_rows"):
        session(fresh, ledger_rows=rows)


def test_ledger_says_a_turn_far_from_every_boundary_used_the_estimate(fresh):
    """Once the server's count has been seen (a backend's first request is counted exactly), a small turn is
    decided on the local estimate, says so in the ledger, and sends no /tokenize."""
    msgs, tools = conversation(0)
    with session(fresh) as s:
        s.completion(messages=msgs[:1], tools=tools, max_tokens=4)
        fresh["fast"].clear_requests()
        s.completion(messages=msgs, tools=tools, max_tokens=4)
    row = s.ledger[-1]
    assert row.count_source == "tiktoken" and row.count_kind == "estimate" and row.tool_tokens > 600
    assert [r for r in fresh["fast"].requests if r.path == "/tokenize"] == []


async def test_async_twin_routes_the_same(fresh):
    """acompletion makes the same decisions as completion, through litellm's async client."""
    msgs, tools = conversation(8)
    async with session(fresh) as s:
        resp = await s.acompletion(messages=msgs, tools=tools, max_tokens=4)
        assert resp.choices and s.last_route.backend == "slow" and chat_requests(fresh["fast"]) == []
        small, tools = conversation(0)
        await s.acompletion(messages=small, tools=tools, max_tokens=4)
        assert s.last_route.backend == "fast"


def test_unknown_errors_pass_through(fresh):
    """An error that is not an overflow reaches the caller untouched."""
    fast = Backend("hosted_vllm/no-such-model", api_base=fresh["fast"].api_base, name="fast", window=2048)
    with session(fresh, fast=fast) as s, pytest.raises(Exception) as info:
        s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "ContextOverflow" not in type(info.value).__name__


def test_unmappable_cloud_slow_keeps_request_local(fresh):
    """A cloud slow model missing from litellm's catalog is never escalated to; the reason is logged."""
    fast, _ = backends(fresh)
    cloud = Backend("openai/no-such-model-in-any-catalog", name="cloud")
    msgs, tools = conversation(0)
    with capture_events() as events, session(fresh, fast=fast, slow=cloud) as s:
        s.completion(messages=msgs, tools=tools, max_tokens=4)
        assert s.last_route.backend == "fast"
        big, tools = conversation(12)
        with pytest.raises(ContextOverflowError):
            s.completion(messages=big, tools=tools, max_tokens=4)
    assert "catalog" in s.last_route.note and s.stats()["catalog_refusals"] == 1
    assert any(e["event"] == "route" and e.get("note") and "catalog" in e["note"] for e in events)


class RecordingCloud:
    """Stands in for a cloud provider that cannot be reached from here: it records the call and answers."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def completion(self, **kwargs):
        if kwargs.get("api_base"):
            return self.real.completion(**kwargs)
        self.calls.append(kwargs)
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {}}


def test_catalogued_cloud_slow_takes_the_overflow(fresh):
    """A cloud slow model in litellm's catalog gets the request that does not fit, with no cache_salt."""
    from agentkv._support.env import import_litellm

    fast, _ = backends(fresh)
    cloud = Backend("gpt-4o", name="cloud")
    client = RecordingCloud(import_litellm())
    big, tools = conversation(12)
    with session(fresh, fast=fast, slow=cloud, client=client, tenant="t", cache_salt_secret="k") as s:
        s.completion(messages=big, tools=tools, max_tokens=4)
    assert s.last_route.backend == "cloud" and s.last_route.window and s.last_route.window > 100_000
    assert len(client.calls) == 1 and "extra_body" not in client.calls[0] and client.calls[0]["model"] == "gpt-4o"


@pytest.mark.parametrize("budget", [{"max_completion_tokens": 600}, {"max_tokens": None, "max_completion_tokens": 600},
                                    {"max_tokens": 600, "max_completion_tokens": 600}])
def test_clamp_honours_max_completion_tokens(fresh, budget):
    """The budget vLLM obeys (max_completion_tokens first) is the one routing clamps, in every key the caller set."""
    msgs, tools = conversation(6)
    with session(fresh) as s:
        resp = s.completion(messages=msgs, tools=tools, **budget)
    body = chat_requests(fresh["fast"])[-1]
    assert resp.choices and s.last_route.reason == "clamped" and s.stats()["overflow_errors"] == 0
    assert body.get("max_completion_tokens", body.get("max_tokens")) == s.last_route.max_tokens < 600


def test_reactive_escalation_fits_the_slow_window(fresh):
    """With a stale fast window and a count 30% low, the caller still gets an answer from slow, its budget counted
    from the surest prompt figure there is (fast's "at least L+1" beats the low count, no clamp retried on fast); with
    no exact count allowed, what slow then cuts is recorded as a server clamp."""
    fresh["slow"].max_model_len = 2600
    fast, slow = backends(fresh, window=8192)
    msgs, tools = conversation(10)  # over fast's real 2048 (its 400), within slow's 2600
    with session(fresh, fast=fast, slow=slow, count_with_server=False) as s:
        s._parts.counters["fast"] = TokenCounter([UnderCount()])
        resp = s.completion(messages=msgs, tools=tools, max_tokens=2000)
    sent = [b["max_tokens"] for b in chat_requests(fresh["slow"]) if b["max_tokens"] != 1]
    assert resp.choices and s.last_route.backend == "slow" and len(chat_requests(fresh["fast"])) == 1
    assert sent == [s.last_route.max_tokens] == [2600 - 2049]
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens <= 2600 and s.stats()["server_clamps"] == 1


def test_uncopyable_kwargs_pass_through_untouched(fresh):
    """Values agentkv does not edit reach litellm as the caller's own objects, copyable or not."""
    import threading

    seen = {}

    class Spy:
        def completion(self, **kwargs):
            seen.update(kwargs)
            return {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {}}

    lock, msgs = threading.Lock(), [{"role": "user", "content": "hi"}]
    with Session(Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", window=4096), client=Spy(),
                 count_with_server=False) as s:
        s.completion(messages=msgs, max_tokens=4, metadata={"lock": lock})
    assert seen["metadata"]["lock"] is lock and seen["messages"] == msgs and seen["messages"] is not msgs
