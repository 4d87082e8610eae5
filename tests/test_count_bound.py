"""The estimate bound learns from every exact count, and a silent server clamp is seen: against a fake vLLM 0.32."""

import math
import uuid

import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv.http.transport import HttpError
from agentkv.testing import FakeClock, FakeHttp, capture_events, models_answer
from agentkv.tokens import Payload, TiktokenSource, TokenCount, TokenCounter, payload_from_request
from agentkv.tokens.bound import EstimateBound
from agentkv.warm import WarmAheadPolicy


class BadRequestError(Exception):
    status_code = 400


class FakeVLLM:
    """A fast/slow pair as vLLM 0.32 answers: ``GET /v1/models``, ``POST /tokenize``, and chat completions whose
    ``usage.prompt_tokens`` is the tokenizer's count (``ratio`` times cl100k's estimate; ``tokenize_ratio`` for
    /tokenize when it differs). A prompt over the window is a 400; a prompt plus ``max_tokens`` over it is cut
    silently (200, ``finish_reason: "length"``). Each pair has fresh model ids, so a fresh estimate bound."""

    def __init__(self, *, ratio=2.2, tokenize_ratio=None, fast_window=2048, slow_window=8192):
        tag = uuid.uuid4().hex[:8]
        self.models = {"fast": f"fast-{tag}", "slow": f"slow-{tag}"}
        self.urls = {"fast": "http://127.0.0.1:9311/v1", "slow": "http://127.0.0.1:9312/v1"}
        self.windows = {"fast": fast_window, "slow": slow_window}
        self.ratio, self.tokenize_ratio = ratio, ratio if tokenize_ratio is None else tokenize_ratio
        self.http = FakeHttp(self._http)
        self.sent = []
        self._estimate = TiktokenSource()

    def backend(self, role, window=None):
        return Backend(f"hosted_vllm/{self.models[role]}", api_base=self.urls[role], name=role, window=window)

    def tokens(self, payload, ratio=None):
        return round((self.ratio if ratio is None else ratio) * self._estimate.count(payload).total)

    def _role(self, url):
        return "fast" if url.startswith(self.urls["fast"].removesuffix("/v1")) else "slow"

    def _http(self, method, url, body):
        role = self._role(url)
        if url.endswith("/models"):
            return models_answer(self.models[role], self.windows[role])
        if url.endswith("/tokenize"):
            payload = payload_from_request(body)
            return {"count": self.tokens(payload, self.tokenize_ratio), "max_model_len": self.windows[role]}
        raise HttpError("not found", status_code=404)

    def _answer(self, kwargs):
        self.sent.append(kwargs)
        asked = kwargs.get("max_tokens")
        prompt, window = self.tokens(payload_from_request(kwargs)), self.windows[self._role(kwargs["api_base"])]
        if prompt > window:
            raise BadRequestError(f"This model's maximum context length is {window} tokens. However, you requested "
                                  f"{prompt + (asked or 0)} tokens ({prompt} in the messages, {asked or 0} in the "
                                  "completion). Please reduce the length of the messages or completion.")
        completion = min(asked or window - prompt, window - prompt)  # random weights: it runs to its budget
        self.last_usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "prompt_tokens_details": {"cached_tokens": 0}}
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                "usage": self.last_usage}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        return self._answer(kwargs)

    def session(self, *, fast_window=None, **kwargs):
        kwargs.setdefault("warm_ahead", WarmAheadPolicy(enabled=False))
        return Session(self.backend("fast", fast_window), self.backend("slow"), http=self.http, client=self,
                       discovery=WindowDiscovery(http=self.http), **kwargs)

    def tokenize_calls(self):
        return sum(c.url.endswith("/tokenize") for c in self.http.calls)


def prose(words, tag=""):
    """English prose (the tier's tokenizer counts it at about twice cl100k's rate)."""
    text = " ".join(["the committee reviewed the quarterly report and agreed"] * (words // 8))
    return [{"role": "user", "content": f"{tag or uuid.uuid4()} {text}"}]


def routes(session):
    return [(row.backend, row.reason, row.count_kind) for row in session.ledger]


# --------------------------------------------------------------------------- the bound and the counter


def test_a_first_request_to_a_backend_of_unknown_ratio_is_counted_exactly():
    """A counter whose bound has seen no exact count asks /tokenize even where the estimate's interval would
    decide; after that one count, an interval that decides is enough."""
    fake = FakeVLLM(ratio=1.0)
    counter = TokenCounter.for_backend(fake.backend("fast"), http=fake.http)
    counter.bound = EstimateBound()
    first = counter.count_for(Payload(tuple(prose(400))), lambda low, high: True)
    assert first.exact and first.source == "server" and counter.bound.known
    second = counter.count_for(Payload(tuple(prose(480))), lambda low, high: True)
    assert not second.exact and counter.exact_asked == 1


def estimate(total, safe=None, low=None, high=None):
    """A tiktoken-like estimate: safe = total * 1.15, the slack of 40 on either side."""
    safe = safe if safe is not None else round(total * 1.15)
    return TokenCount(total, safe, 0, "tiktoken", False, low if low is not None else round(total / 1.15) - 40,
                      high if high is not None else safe + 40)


def test_the_bound_learns_a_ratio_within_its_limit_and_then_gives_up():
    """A count inside the interval and the 15% margin only makes the ratio known; one above the interval sets the
    high factor to the ratio seen with 10% headroom (scaling the proportional part, the slack kept), so the same
    ratio on a longer turn falls inside; one below widens the low side alone; past 4x the bound is exhausted and
    its counter asks the exact source for every decision."""
    bound = EstimateBound()
    assert not bound.learn(estimate(1000), 1100) and bound.factor == 1.0 and bound.known
    assert bound.learn(estimate(1000), 3000) and bound.high_factor == pytest.approx(3.3) and bound.low_factor == 1.0
    widened = bound.apply(estimate(1000))
    assert (widened.low, widened.safe, widened.high - widened.safe) == (830, math.ceil(1150 * bound.high_factor), 40)
    assert not bound.exhausted
    assert not bound.learn(bound.apply(estimate(2000)), 6000)
    assert bound.learn(bound.apply(estimate(1000)), 400) and bound.low_factor == pytest.approx(830 / 400 * 1.1)
    assert bound.learn(bound.apply(estimate(1000)), 5000) and bound.high_factor == 4.0 and bound.exhausted


def test_a_short_request_inside_the_slack_leaves_the_ratio_unknown():
    """An exact count of a request so short that the template slack could hide any ratio teaches nothing: the
    ratio stays unknown (the next request is counted exactly too) until a long one is seen."""
    bound = EstimateBound()
    assert not bound.learn(estimate(20), 50) and not bound.known  # 2.5x, hidden inside the slack of 40
    assert not bound.learn(estimate(400), 440) and bound.known


def test_a_ratio_past_the_margin_on_a_long_request_widens_even_inside_the_interval():
    """A long request counted at 1.27x its estimate (inside the interval's slack, past its 15% margin) widens the
    high side to that ratio with 10% headroom, logged as count_bound_learned: at once from /tokenize, from answers'
    usage once three of them from two Sessions agree (issue 37: no single answer widens the bound)."""
    bound, claimed = EstimateBound(), EstimateBound()
    with capture_events() as events:
        assert bound.learn(estimate(300), 380, backend="fast", origin="tokenize")  # safe 345, high 385
        assert not claimed.learn(estimate(300), 380, backend="fast", origin="usage", session="a")
        assert not claimed.learn(estimate(300), 380, backend="fast", origin="usage", session="a")
        assert claimed.learn(estimate(300), 380, backend="fast", origin="usage", session="b")
    assert bound.high_factor == claimed.high_factor == pytest.approx(380 / 300 * 1.1)
    assert [(e["event"], e["origin"]) for e in events] == [("count_bound_learned", "tokenize"),
                                                           *[("count_bound_claimed", "usage")] * 2,
                                                           ("count_bound_learned", "usage")]


def test_the_estimate_bound_is_learned_per_server_and_model():
    """Widening learned on one model does not widen another model behind the same URL (or with the same label),
    and only ever grows: a later in-bound count never narrows it."""
    def counter(model, name=None):
        return TokenCounter.for_backend(Backend(model, api_base="http://127.0.0.1:9/v1", name=name, window=4096))

    tag = uuid.uuid4().hex[:6]
    wide, other = counter(f"hosted_vllm/bound-a-{tag}", "b"), counter(f"hosted_vllm/bound-b-{tag}", "b")
    same = counter(f"hosted_vllm/bound-a-{tag}")
    assert wide.bound is same.bound and wide.bound is not other.bound
    assert wide.bound.learn(estimate(100), 300) and other.bound.factor == 1.0 and not other.bound.known
    grown = wide.bound.factor
    assert not wide.bound.learn(wide.bound.apply(estimate(100)), 150) and wide.bound.factor == grown


def test_a_count_above_the_interval_widens_only_its_high_side_and_raises_the_safe_figure():
    """An exact count 2.2x the estimate widens the high end (and the safe figure the clamp uses) so that the same
    shape's next estimate holds it; the low end, never violated, stays where the documented bound puts it."""
    source, bound = TiktokenSource(), EstimateBound()
    estimate = source.count(Payload(tuple(prose(400, "a"))))
    assert bound.learn(estimate, round(2.2 * estimate.total), origin="tokenize")  # an exact source: widens alone
    later = source.count(Payload(tuple(prose(440, "b"))))
    widened = bound.apply(later)
    assert widened.low == later.low and widened.high > 2.2 * later.total
    assert widened.safe >= 2.2 * later.total > later.safe
    assert not bound.learn(widened, round(2.2 * later.total))  # held now: nothing more to learn


# --------------------------------------------------------------------------- the Session learns


def test_every_answer_teaches_the_bound_its_prompt_tokens():
    """/tokenize agrees with the estimate on the first turn, but the server counts what it is sent at 2.2x: the
    answer's usage.prompt_tokens widens the bound (origin "usage"), and the next turn near the boundary, whose
    unwidened interval would have sent it to fast, is counted exactly and goes to slow."""
    fake = FakeVLLM(ratio=2.2, tokenize_ratio=1.0)
    with fake.session() as s, capture_events() as events:
        s.completion(messages=prose(200), max_tokens=8)
        assert [e["origin"] for e in events if e["event"] == "count_bound_exceeded"] == ["usage"]
        fake.tokenize_ratio = 2.2  # from here /tokenize tells the truth as well
        near = prose(800)  # estimate ~840, interval up to ~1010: fast unwidened; 2.2x of it is over 2048 - 256
        assert fake.tokens(payload_from_request({"messages": near})) + 256 > 2048
        s.completion(messages=near, max_tokens=8)
    assert routes(s)[-1] == ("slow", "proactive", "exact")
    assert s.stats()["overflow_errors"] == 0


def test_the_exact_count_taken_while_recovering_teaches_the_bound():
    """A turn decided on the estimate overflows fast; the count taken to recover widens the bound (origin
    "recovery"), so the identical request next time goes straight to slow instead of paying the same 400."""
    fake = FakeVLLM(ratio=1.0)
    with fake.session() as s:
        s.completion(messages=prose(400), max_tokens=8)  # the first count: /tokenize, agreeing with the estimate
    fake.ratio = fake.tokenize_ratio = 2.2
    big = prose(960)  # estimate ~1.0K, interval up to ~1.2K (fast, unwidened); 2.2x is ~2.2K, over fast's 2048
    with fake.session() as first, capture_events() as events:
        first.completion(messages=big, max_tokens=8)
    assert routes(first) == [("slow", "reactive_escalate", "estimate")]
    assert "recovery" in [e["origin"] for e in events if e["event"] == "count_bound_exceeded"]
    with fake.session() as again:
        again.completion(messages=big, max_tokens=8)
    assert routes(again) == [("slow", "proactive", "exact")] and again.stats()["overflow_errors"] == 0


def test_warm_ahead_fires_on_the_first_turn_at_the_threshold_in_a_fresh_process():
    """A growing conversation on a backend counting 2.2x cl100k, its bound fresh: the first turn is counted
    exactly, and warm-ahead fires on the first turn whose real count reaches 60% of fast's window."""
    fake = FakeVLLM(ratio=2.2)
    messages, fired, first_over = [], [], None
    with fake.session(warm_ahead=WarmAheadPolicy()) as s:
        for turn in range(12):
            messages = messages + prose(48, f"turn {turn}")
            s.completion(messages=messages, max_tokens=8)
            s.drain_warms(10)
            if first_over is None and fake.tokens(payload_from_request({"messages": messages})) >= 0.6 * 2048:
                first_over = turn
            fired.append(s.ledger[-1].warm == "fire")
    assert first_over is not None and fired.index(True) == first_over


# --------------------------------------------------------------------------- the silent server clamp


def test_a_silent_server_clamp_is_recorded_and_the_real_window_read_again():
    """With fast's window declared too large (4096 on a 2048 server), the budget the Session sent is cut by the
    server (200, "length", fewer tokens): it is counted as a server clamp, warned about with sizes only, and the
    next request, routed with the server's window, is clamped by agentkv itself so the server cuts nothing."""
    fake = FakeVLLM(ratio=1.0)
    messages = prose(1200)  # ~1.4K tokens: fits 2048, but not with 1000 more
    with fake.session(fast_window=4096) as s, capture_events() as events:
        s.completion(messages=messages, max_tokens=1000)
        assert s.stats()["server_clamps"] == 1 and s.last_route.window == 4096
        (clamp,) = [e for e in events if e["event"] == "server_clamp"]
        assert clamp["max_tokens"] == 1000 and clamp["prompt_tokens"] + clamp["completion_tokens"] == 2048
        assert clamp["server_window"] == 2048 and clamp["log_level"] == "warning"
        assert not {"messages", "content", "prompt"} & set(clamp)
        s.completion(messages=messages, max_tokens=1000)
    assert s.last_route.reason == "clamped" and s.last_route.window == 2048
    assert s.stats()["server_clamps"] == 1
    assert fake.sent[-1]["max_tokens"] + fake.last_usage["prompt_tokens"] <= 2048


async def test_a_server_clamp_reported_at_the_end_of_a_stream_is_recorded_too():
    """A streamed answer reports its finish reason in one chunk and its usage in a later one: the clamp is seen."""
    from agentkv.wire.usage import StreamWatcher

    fake = FakeVLLM(ratio=1.0)

    async def stream(**kwargs):
        answer = fake._answer(kwargs)
        async def chunks():
            yield {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
            yield {"choices": [{"index": 0, "delta": {}, "finish_reason": answer["choices"][0]["finish_reason"]}]}
            yield {"choices": [], "usage": answer["usage"]}
        return StreamWatcherSource(chunks())

    fake.acompletion = stream
    async with fake.session(fast_window=4096) as s:
        reply = await s.acompletion(messages=prose(1200), max_tokens=1000, stream=True)
        assert isinstance(reply, StreamWatcher)
        assert [c async for c in reply][-1]["usage"]["completion_tokens"] < 1000
        assert s.stats()["server_clamps"] == 1


class StreamWatcherSource:
    """An async stream as litellm returns one."""

    def __init__(self, chunks):
        self._chunks = chunks

    def __aiter__(self):
        return self._chunks.__aiter__()


@pytest.mark.parametrize("usage, sent, clamped", [
    ((100, 348, None, "length"), 1000, True),   # cut below what was sent
    ((100, 1000, None, "length"), 1000, False),  # the Session's own budget ran out
    ((100, 12, None, "stop"), 1000, False),     # the model stopped
    ((100, 348, None, "length"), None, False),  # nothing sent: the server's default budget is no clamp
    ((None, None, None, "length"), 1000, False),
])
def test_server_clamped_reads_a_cut_budget_only(usage, sent, clamped):
    """Only "length" with fewer completion tokens than the budget sent is a server clamp."""
    from agentkv.wire.usage import Usage, server_clamped

    assert server_clamped(Usage(*usage), sent) is clamped


def test_response_usage_reads_dicts_and_objects():
    """Prompt, completion and cached tokens and the first finish reason, from a dict or an attribute object."""
    from agentkv.wire.usage import Usage, response_usage

    class Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    answer = {"choices": [{"finish_reason": "length"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}}
    assert response_usage(answer) == Usage(7, 3, 0, "length")
    obj = Obj(choices=[Obj(finish_reason="stop")], usage=Obj(prompt_tokens=7, completion_tokens=True))
    assert response_usage(obj) == Usage(7, None, None, "stop")


# --------------------------------------------------------------------------- discovery after a clamp


def test_rediscover_reads_the_server_and_lets_it_overrule_a_declared_window_only_when_it_differs():
    """After a server clamp a declared window is checked against /v1/models: a different max_model_len wins, an
    equal one leaves it declared; an undeclared backend is read again, at most once per 30 s however often the
    server keeps cutting budgets (an output cap of its own)."""
    fake, clock = FakeVLLM(), FakeClock()
    discovery = WindowDiscovery(http=fake.http, timer=clock)
    declared, plain = fake.backend("fast", 4096), fake.backend("fast")
    assert discovery.window(declared, model_known=False).source == "declared"
    assert not fake.http.calls
    discovery.rediscover(declared)
    info = discovery.window(declared, model_known=False)
    assert (info.window, info.source) == (2048, "server")
    exact = fake.backend("fast", 2048)
    discovery.rediscover(exact)
    assert discovery.window(exact, model_known=False).source == "declared"
    assert discovery.window(plain).window == 2048
    fetched = len(fake.http.calls)
    discovery.rediscover(plain)
    assert discovery.window(plain).window == 2048 and len(fake.http.calls) == fetched  # read 0 s ago
    clock.advance(31)
    discovery.rediscover(plain)
    assert discovery.window(plain).window == 2048 and len(fake.http.calls) == fetched + 1
    discovery.invalidate(declared)
    assert discovery.window(declared, model_known=False).source == "declared"
