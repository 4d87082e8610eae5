"""The HTTP seam: the async drivers never make a sync HTTP call on the event loop, and one fake serves both paths."""

import asyncio

import pytest

from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.testing import FakeHttp, models_answer
from agentkv.tokens.encodings import encode, get_encoding
from agentkv.tokens.templates import render_chat
from agentkv.warm import CooldownMap, InFlightLimit

FAST, SLOW = "http://127.0.0.1:9101/v1", "http://127.0.0.1:9102/v1"
WINDOWS = {FAST: 2048, SLOW: 16384}
SYSTEM = {"role": "system", "content": "You are a careful operations agent."}


def vllm_like(method, url, body):
    """/v1/models and /tokenize answered the way vLLM answers them (token ids from the ChatML template)."""
    base = url.rsplit("/", 1)[0]
    if method == "GET" and url.endswith("/models"):
        model = "fast-m" if base == FAST else "slow-m"
        return models_answer(model, WINDOWS[base])
    if method == "POST" and url.endswith("/tokenize"):
        text = render_chat(body["messages"], body.get("tools"),
                           add_generation_prompt=body.get("add_generation_prompt", True))
        tokens = encode(get_encoding(), text)
        return {"count": len(tokens), "max_model_len": WINDOWS[base + "/v1"], "tokens": tokens, "token_strs": None}
    if method == "POST" and url.endswith("/chat/completions") and body.get("max_tokens") == 1:  # a warm
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "."}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    return 404, {"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}}


class Answers:
    """A completion client that answers every request with a short reply and vLLM-style usage."""

    def __init__(self):
        self.sent = []

    def _answer(self, kwargs):
        self.sent.append(kwargs)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        await asyncio.sleep(0)
        return self._answer(kwargs)


def turns(n):
    """A conversation growing by ~150 tokens a turn."""
    messages = [SYSTEM]
    for i in range(n):
        messages = messages + [{"role": "user", "content": f"Step {i}: " + "check the disk latency graphs " * 20},
                               {"role": "assistant", "content": f"Noted step {i}."}]
        yield messages + [{"role": "user", "content": "What next?"}]


def make_session(http, declared):
    fast = Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=2048 if declared else None)
    slow = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", window=16384 if declared else None)
    return Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, client=Answers(),
                   cooldowns=CooldownMap(), in_flight=InFlightLimit(4), tenant="t", cache_salt_secret="k",
                   warm_ahead=WarmAheadPolicy())


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "discovered"])
async def test_async_escalation_after_a_warm_makes_no_sync_http_call(declared):
    """acompletion, aobserve and aroute through a warm and an escalation make every HTTP call async."""
    http = FakeHttp(vllm_like)
    s = make_session(http, declared)
    for messages in turns(30):
        await s.acompletion(messages=messages, max_tokens=8)
        if s.last_route.role == "slow":
            break
    await s.adrain_warms(10)
    await s.aobserve(messages=messages, max_tokens=8)
    await s.aroute(messages=messages, max_tokens=8)
    report = await s.aprefix_report()  # the last two requests: the escalated one and its observed repeat
    assert report is not None and report.intact and report.exact
    assert s.last_route.role == "slow" and s.stats()["warm_fired"] == 1 and s.stats()["escalations_after_warm"] == 1
    assert any(c.url.endswith("/tokenize") for c in http.calls)
    assert any(c.url.endswith("/models") for c in http.calls)  # the slow model's listing, also when declared
    assert http.blocking_calls == [] and all(c.asynchronous for c in http.calls)


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "discovered"])
def test_sync_escalation_goes_through_the_same_fake(declared):
    """completion uses the same injected fake for /models and /tokenize, synchronously."""
    http = FakeHttp(vllm_like)
    s = make_session(http, declared)
    for messages in turns(30):
        s.completion(messages=messages, max_tokens=8)
        if s.last_route.role == "slow":
            break
    assert s.drain_warms(10)
    assert s.last_route.role == "slow" and s.stats()["warm_fired"] == 1 and s.stats()["escalations_after_warm"] == 1
    assert http.calls and not any(c.asynchronous for c in http.calls)
    assert {c.url.rsplit("/", 1)[1] for c in http.calls} == {"models", "tokenize", "completions"}  # + the warm
    assert s.stats()["warm_completed"] == 1


async def test_the_spy_sees_a_sync_call_made_on_the_loop():
    """The check itself: a sync call made while the loop runs is reported as blocking."""
    http = FakeHttp(vllm_like)
    http.get_json(FAST + "/models", timeout_s=1.0)
    assert len(http.blocking_calls) == 1
