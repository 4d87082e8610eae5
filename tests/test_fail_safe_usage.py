"""Hostile or broken usage numbers (issue 37, findings 8 to 10): a server's usage figures are data, validated in one
place; a bad one is treated as absent and named in an event, the answer reaches the caller as it came, no figure
goes negative or absurd, and no single answer widens the count bound every Session routes by."""

import asyncio
import json
import math
import uuid

import pytest

from raw_server import COMPLETION, FIRST_EVENT, SSE_HEAD, RawServer, json_answer

from agentkv import Backend, RetryPolicy, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.testing.providers.anthropic import FakeAnthropic
from agentkv.testing import FakeHttp, capture_events, models_answer
from agentkv.tokens import TokenCount
from agentkv.tokens.bound import EstimateBound
from agentkv.wire.usage import MAX_REPORTED_TOKENS, Usage, response_usage

HUGE = 10 ** 400
HI = [{"role": "user", "content": "hi"}]


def rejected(events):
    """The (field, reason) of every ``usage_rejected`` event."""
    return [(e["field"], e["reason"]) for e in events if e["event"] == "usage_rejected"]


def no_huge_text(events):
    """No event carries the huge figure's text (or any part of it long enough to matter), and the figure was refused
    where it was read: nothing that learns from the answer failed on it."""
    return all("0" * 40 not in repr(e) for e in events) and "usage_unlearned" not in [e["event"] for e in events]


# --------------------------------------------------------------------------- reading: the one pure place

@pytest.mark.parametrize("value, reason", [
    (1.5, "not an integer"), (7.0, "not an integer"), ("12", "not an integer"), (True, "not an integer"),
    (float("nan"), "not an integer"), (float("inf"), "not an integer"), ([3], "not an integer"),
    (-1, "negative"), (MAX_REPORTED_TOKENS + 1, "past the bound"), (HUGE, "past the bound"),
])
def test_a_bad_figure_is_read_as_absent_and_named(value, reason):
    """Every count of an answer's usage is checked: a non-integer (float, string, bool, NaN), a negative or a value
    past 2**31 is read as absent, and the Usage says which field and why (never the value)."""
    answer = {"usage": {"prompt_tokens": value, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": value},
                        "cache_creation_input_tokens": value}}
    usage = response_usage(answer)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.cache_write_tokens) == (
        None, 3, None, None)
    assert ("usage.prompt_tokens", reason) in usage.rejected
    assert ("usage.prompt_tokens_details.cached_tokens", reason) in usage.rejected
    assert ("usage.cache_creation_input_tokens", reason) in usage.rejected
    assert "0" * 40 not in repr(usage)


def test_good_figures_are_read_as_they_came():
    """Zero and the bound itself are figures; absent ones are absent, not rejected."""
    usage = response_usage({"usage": {"prompt_tokens": MAX_REPORTED_TOKENS, "completion_tokens": 0}})
    assert usage == Usage(MAX_REPORTED_TOKENS, 0, None, None, None)


# --------------------------------------------------------------------------- finding 8: an answer fails its own turn

def _session(fast_url, slow_url=None, **kwargs):
    """A Session on hosted_vllm backends at ``fast_url`` (and ``slow_url``), litellm's real provider code between."""
    fast = Backend("hosted_vllm/fast-m", api_base=fast_url + "/v1", name="fast", window=2048)
    slow = Backend("hosted_vllm/slow-m", api_base=slow_url + "/v1", name="slow", window=16384) if slow_url else None
    http = FakeHttp(lambda m, u, b: models_answer("fast-m" if u.startswith(fast_url) else "slow-m",
                                                  2048 if u.startswith(fast_url) else 16384))

    async def no_asleep(seconds):
        return None

    return Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, count_with_server=False,
                   retry=RetryPolicy(sleep=lambda seconds: None, asleep=no_asleep),
                   warm_ahead=WarmAheadPolicy(enabled=False), **kwargs)


def _chunked(data):
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _stream_answer(usage):
    last = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}]}
    tail = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
            "usage": usage}
    events = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (last, tail)) + b"data: [DONE]\n\n"
    return SSE_HEAD + _chunked(FIRST_EVENT + events) + b"0\r\n\r\n"


@pytest.mark.parametrize("mode", ["sync", "async", "stream"])
def test_a_huge_prompt_count_from_hosted_vllm_never_fails_the_turn(mode):
    """hosted_vllm answers with ``prompt_tokens`` 10**400 (today: OverflowError in the count bound, after the answer
    arrived): the answer comes back with its usage as it came, and an event names the field, not its value."""
    usage = {"prompt_tokens": HUGE, "completion_tokens": 1, "total_tokens": 6}
    payload = _stream_answer(usage) if mode == "stream" else json_answer(200, {**COMPLETION, "usage": usage})
    with RawServer("raw", payload=payload) as fast, capture_events() as events:
        s = _session(fast.url)
        if mode == "async":
            response = asyncio.run(s.acompletion(messages=HI, max_tokens=4))
        elif mode == "sync":
            response = s.completion(messages=HI, max_tokens=4)
        else:
            chunks = list(s.completion(messages=HI, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    if mode == "stream":
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    else:
        assert response.choices[0].message.content == "ok" and response.usage.prompt_tokens == HUGE
    assert ("usage.prompt_tokens", "past the bound") in rejected(events)
    assert no_huge_text(events) and s.stats()["requests_total"] == 1


class HostileAnthropic(FakeAnthropic):
    """The Anthropic fake, its answers' usage overwritten by ``usage``."""

    usage: dict = {}

    def _answer(self, model, usage, max_tokens):
        answer = dict(super()._answer(model, usage, max_tokens))
        answer["usage"] = {**answer["usage"], **self.usage}
        return answer


def _anthropic(fake):
    """A Session whose fast backend is Claude on the fake (so its figures are priced), nothing to escalate to."""
    fast = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", name="fast")
    return Session(fast, None, warm_ahead=WarmAheadPolicy(enabled=False))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_huge_input_count_from_anthropic_never_fails_the_turn(asynchronous):
    """Claude's ``input_tokens`` of 10**400 (litellm sums it into ``prompt_tokens``): the answer comes back, an event
    names the field, and nothing is priced from it."""
    with HostileAnthropic() as fake, capture_events() as events:
        fake.usage = {"input_tokens": HUGE}
        with _anthropic(fake) as s:
            call = s.acompletion if asynchronous else None
            response = (asyncio.run(call(messages=HI, max_tokens=4)) if call
                        else s.completion(messages=HI, max_tokens=4))
            stats = s.stats()
    assert response.choices[0].message.content and response.usage.prompt_tokens >= HUGE
    assert ("usage.prompt_tokens", "past the bound") in rejected(events) and no_huge_text(events)
    assert 0 <= stats["cost_usd"] < 0.01


# --------------------------------------------------------------------------- finding 9: negative or absurd figures

def test_negative_counts_never_make_a_negative_figure():
    """Claude answering ``input_tokens`` -100 and ``cache_read_input_tokens`` -1,800,000 (today: cost_usd -0.54,
    cache_saved_usd -4.86, cache_read_tokens and the ledger's cached_tokens -1,800,000): every figure stays >= 0."""
    with HostileAnthropic() as fake, capture_events() as events:
        fake.usage = {"input_tokens": -100, "cache_read_input_tokens": -1_800_000}
        with _anthropic(fake) as s:
            s.completion(messages=HI, max_tokens=4)
            stats, ledger = s.stats(), s.ledger
    figures = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert min(figures.values()) >= 0, {k: v for k, v in figures.items() if v < 0}
    assert ledger[-1].cached_tokens is None and stats["cached_tokens_unknown"] == 1
    assert {field for field, _ in rejected(events)} >= {"usage.prompt_tokens", "usage.cache_read_input_tokens"}
    assert all(e.get("cost_usd") is None or e["cost_usd"] >= 0 for e in events)


def test_an_absurd_input_count_is_not_priced():
    """``input_tokens`` of 10**20 (today: cost_usd 3e14) is past the bound: refused, and the answer costs what its
    other figures say (cents at most)."""
    with HostileAnthropic() as fake, capture_events() as events:
        fake.usage = {"input_tokens": 10 ** 20}
        with _anthropic(fake) as s:
            s.completion(messages=HI, max_tokens=4)
            stats = s.stats()
    assert 0 <= stats["cost_usd"] < 0.01
    assert ("usage.prompt_tokens", "past the bound") in rejected(events)


def test_a_negative_cached_count_from_vllm_stays_out_of_the_ledger():
    """A vLLM answer with ``cached_tokens`` -5 (and the record_usage a framework callback makes with one): the
    ledger holds unknown, never a negative count, and the event names the field."""
    answer = {**COMPLETION, "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": -5}}}
    with RawServer("raw", payload=json_answer(200, answer)) as fast, capture_events() as events:
        s = _session(fast.url)
        s.completion(messages=HI, max_tokens=4)
        observation = s.observe(messages=HI, max_tokens=4)
        s.record_usage(observation.turn, cached_tokens=-7)
    assert [row.cached_tokens for row in s.ledger] == [None, None]
    assert s.stats()["cached_tokens_total"] == 0 and s.stats()["cached_tokens_unknown"] == 2
    assert rejected(events) == [("usage.prompt_tokens_details.cached_tokens", "negative"),
                                ("cached_tokens", "negative")]


# --------------------------------------------------------------------------- finding 10: one answer moves every Session

class Claims:
    """A completion client answering every request with ``usage.prompt_tokens`` from ``claims`` (the next one each
    answer; then the request's real size, ``ratio`` times cl100k's estimate)."""

    def __init__(self, ratio=1.0):
        from agentkv.tokens import TiktokenSource, payload_from_request

        self.claims, self.ratio, self.sent = [], ratio, []
        self._estimate, self._payload = TiktokenSource(), payload_from_request

    def _answer(self, kwargs):
        self.sent.append(kwargs)
        real = round(self.ratio * self._estimate.count(self._payload(kwargs)).total)
        prompt = self.claims.pop(0) if self.claims else real
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        return self._answer(kwargs)


def _pair(client, tag, fast_window=4096):
    """A Session on a fast/slow pair (fresh model ids: a fresh bound) with no exact count source: every turn is
    routed on the estimate and the bound learned from answers."""
    fast = Backend(f"hosted_vllm/fast-{tag}", api_base="http://127.0.0.1:9411/v1", name="fast", window=fast_window)
    slow = Backend(f"hosted_vllm/slow-{tag}", api_base="http://127.0.0.1:9412/v1", name="slow", window=32768)
    http = FakeHttp(lambda m, u, b: models_answer(f"fast-{tag}" if ":9411" in u else f"slow-{tag}",
                                                  fast_window if ":9411" in u else 32768))
    return Session(fast, slow, http=http, client=client, discovery=WindowDiscovery(http=http), count_with_server=False,
                   warm_ahead=WarmAheadPolicy(enabled=False))


def prose(words):
    text = " ".join(["the committee reviewed the quarterly report and agreed"] * (words // 8))
    return [{"role": "user", "content": f"{uuid.uuid4()} {text}"}]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_one_answer_claiming_ten_million_tokens_moves_no_other_session(asynchronous):
    """Session A's one fast answer reports 10 million prompt tokens (today: the shared bound widens 4x, and Session
    B's 1,500-word prompt, which fits fast, goes to slow); B's prompt still routes fast."""
    client, tag = Claims(), uuid.uuid4().hex[:8]
    client.claims = [10_000_000]

    async def turns():
        async with _pair(client, tag) as a, _pair(client, tag) as b:
            await a.acompletion(messages=prose(40), max_tokens=8)
            await b.acompletion(messages=prose(1500), max_tokens=8)
            return b.last_route

    if asynchronous:
        route = asyncio.run(turns())
    else:
        with _pair(client, tag) as a, _pair(client, tag) as b:
            a.completion(messages=prose(40), max_tokens=8)
            b.completion(messages=prose(1500), max_tokens=8)
            route = b.last_route
    assert (route.role, route.reason) == ("fast", "fits")


def test_three_answers_from_two_sessions_do_widen():
    """A backend whose tokenizer really counts 2.2x cl100k, and no /tokenize: two of Session A's answers do not widen
    the bound, Session B's agreeing third does, and after it a prompt that fits only on the estimate goes to slow."""
    client, tag = Claims(ratio=2.2), uuid.uuid4().hex[:8]
    with _pair(client, tag, fast_window=2048) as a, _pair(client, tag, fast_window=2048) as b, \
            capture_events() as events:
        a.completion(messages=prose(200), max_tokens=8)
        a.completion(messages=prose(240), max_tokens=8)
        bound = a._parts.counters["fast"].bound
        assert bound.high_factor == 1.0 and not [e for e in events if e["event"] == "count_bound_exceeded"
                                                 and e["widened"]]
        b.completion(messages=prose(200), max_tokens=8)
        assert bound.high_factor > 2.2 and b._parts.counters["fast"].bound is bound
        near = prose(800)  # estimate ~0.9K: fast unwidened; 2.2x is ~2K, over 2048 - 256
        b.completion(messages=near, max_tokens=8)
    assert b.last_route.role == "slow"


# --------------------------------------------------------------------------- the bound's rule, unit by unit

def estimate(total):
    """A tiktoken-like estimate: safe = total * 1.15, a slack of 40 on either side."""
    safe = round(total * 1.15)
    return TokenCount(total, safe, 0, "tiktoken", False, round(total / 1.15) - 40, safe + 40)


def test_no_single_answer_widens_and_three_from_two_sessions_widen_to_the_least_of_them():
    """Answers' counts are claims: any number from one Session never widen, two from two Sessions do not either;
    three from two Sessions widen to the least widening they all ask for, so three hostile claims of 10 million
    tokens pull the bound no further than one honest 2.2x claim from another Session asks."""
    bound = EstimateBound()
    for _ in range(3):
        assert not bound.learn(estimate(1000), 10_000_000, origin="usage", session="a")
    assert bound.high_factor == 1.0 and not bound.exhausted
    assert bound.learn(estimate(1000), 2200, origin="usage", session="b")
    assert bound.high_factor == pytest.approx(2.2 * 1.1) and not bound.exhausted
    two = EstimateBound()
    assert not two.learn(estimate(1000), 2200, origin="usage", session="a")
    assert not two.learn(estimate(1000), 2400, origin="usage", session="b") and two.high_factor == 1.0
    assert two.learn(estimate(1000), 2300, origin="usage", session="a")
    assert two.high_factor == pytest.approx(2.2 * 1.1)


def test_an_exact_source_widens_at_once():
    """The server's own /tokenize count (and the count taken while recovering) widens on its own, as before."""
    bound = EstimateBound()
    assert bound.learn(estimate(1000), 2200, origin="tokenize") and bound.high_factor == pytest.approx(2.42)
    other = EstimateBound()
    assert other.learn(estimate(1000), 2200, origin="recovery") and other.high_factor == pytest.approx(2.42)


def test_an_unconfirmed_claim_sends_the_next_count_to_the_exact_source():
    """A claim outside the interval leaves the ratio in doubt (the counter asks /tokenize, which settles it) rather
    than widening anything; a count past any sane bound teaches nothing and raises nothing."""
    bound = EstimateBound()
    assert not bound.learn(estimate(1000), 1000, origin="tokenize") and bound.known
    assert not bound.learn(estimate(1000), 10_000_000, origin="usage", session="a") and not bound.known
    assert not bound.learn(estimate(1000), 1010, origin="tokenize") and bound.known and bound.factor == 1.0
    assert not bound.learn(estimate(1000), HUGE, origin="tokenize") and not bound.learn(estimate(1000), -3)
    assert bound.factor == 1.0 and math.isfinite(bound.high_factor)


def test_one_answer_past_its_byte_ceiling_does_not_break_the_ceiling_for_everyone():
    """An answer's count past its payload's byte ceiling is a claim too (today: one answer stops every Session
    trusting ceilings, for good): it breaks the ceiling once three answers from two Sessions say so; /tokenize at
    once."""
    bound = EstimateBound()
    with capture_events() as events:
        assert not bound.check_ceiling(100, 10_000_000, origin="usage", session="a")
        assert not bound.check_ceiling(100, 10_000_000, origin="usage", session="a")
        assert bound.check_ceiling(100, 90, origin="usage", session="b") and not bound.ceiling_broken
        assert bound.trusts_ceiling
        assert not bound.check_ceiling(100, 150, origin="usage", session="b") and bound.ceiling_broken
    assert [e["broken"] for e in events] == [False, False, True]
    exact = EstimateBound()
    assert not exact.check_ceiling(100, 101, origin="tokenize") and exact.ceiling_broken


# --------------------------------------------------------------------------- the openai SDK's transport

@pytest.mark.parametrize("body", ["huge", "deep"])
def test_the_transport_hands_back_an_answer_whose_usage_is_hostile(body):
    """Through AgentKVTransport, an answer whose ``prompt_tokens`` is 10**400 is refused by name, and one nested
    100,000 deep (today: RecursionError after the answer arrived) is recorded as having no usage: the caller gets
    both answers' bytes as they came."""
    import httpx

    from agentkv.integrations.openai import AgentKVTransport

    if body == "huge":
        payload = json_answer(200, {**COMPLETION, "usage": {"prompt_tokens": HUGE, "completion_tokens": 1}})
    else:
        nested = b"[" * 100_000 + b"]" * 100_000
        payload = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n"
                   b"\r\n" % len(nested) + nested)
    with RawServer("raw", payload=payload) as fast, capture_events() as events:
        s = _session(fast.url)
        client = httpx.Client(transport=AgentKVTransport(s))
        answer = client.post(fast.url + "/v1/chat/completions", json={"model": "fast-m", "messages": HI,
                                                                        "max_tokens": 4})
    assert answer.status_code == 200 and answer.content == payload.partition(b"\r\n\r\n")[2]
    assert rejected(events) == ([("usage.prompt_tokens", "past the bound")] if body == "huge" else [])
    assert no_huge_text(events) and s.ledger[-1].cached_tokens is None


def test_a_warms_negative_counts_never_make_a_negative_figure(fresh):
    """A warm to Claude answered with negative counts (today: warm_cost_usd and cache figures below 0), and the
    escalation after it: every figure stays >= 0, and the warm's refusal is named as the warm's."""
    from test_hosted import TOOLS8, fast_backend, react, run

    with HostileAnthropic() as fake, capture_events() as events:
        fake.usage = {"input_tokens": -100, "cache_creation_input_tokens": -5000, "cache_read_input_tokens": -9000}
        slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", name="slow")
        with Session(fast_backend(fresh), slow) as s:
            run(s, react(20), slow_turns=1, tools=TOOLS8)
            stats = s.stats()
    assert stats["warm_fired"] == 1 and stats["requests"].get("slow") == 1
    figures = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert min(figures.values()) >= 0, {k: v for k, v in figures.items() if v < 0}
    assert any(e["event"] == "usage_rejected" and e.get("warm") for e in events)
