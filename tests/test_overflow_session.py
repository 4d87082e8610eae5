"""A Session learns the window from vLLM 0.32's output-budget refusal: the repeat is clamped before it is sent."""

import asyncio

import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv.testing import FakeHttp, models_answer

FAST, SLOW = "http://127.0.0.1:9201/v1", "http://127.0.0.1:9202/v1"
HI = [{"role": "user", "content": "hi"}]


class BadRequestError(Exception):
    status_code = 400


class Vllm032:
    """A completion client answering as two vLLM 0.32 servers would: fast's max_model_len is 2048."""

    def __init__(self) -> None:
        self.refused = 0

    def _answer(self, kwargs):
        budget = kwargs.get("max_completion_tokens") or kwargs.get("max_tokens")
        if kwargs["api_base"] == FAST and budget is not None and budget > 2048:
            self.refused += 1
            key = "max_completion_tokens" if "max_completion_tokens" in kwargs else "max_tokens"
            raise BadRequestError(f"{key}={budget} cannot be greater than max_model_len=2048. Please request fewer "
                                  f"output tokens. (parameter={key}, value={budget})")
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 1}}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        return self._answer(kwargs)


def _session(client: Vllm032) -> Session:
    http = FakeHttp(lambda method, url, body: models_answer("slow-m", 8192))
    fast = Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=99999)
    slow = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow")
    return Session(fast, slow, client=client, discovery=WindowDiscovery(http=http), http=http, count_with_server=False)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_an_output_budget_refusal_teaches_the_window_sync(key):
    """Declared 99999, served 2048: the first request is clamped after one 400, its repeat before it is sent."""
    client = Vllm032()
    with _session(client) as session:
        session.completion(messages=HI, **{key: 5000})
        assert (client.refused, session.last_route.reason) == (1, "reactive_clamp")
        session.completion(messages=HI, **{key: 5000})
        assert (client.refused, session.last_route.reason, session.last_route.window) == (1, "clamped", 2048)


def test_an_output_budget_refusal_teaches_the_window_async():
    """The async twin: one 400 over two identical requests."""
    client = Vllm032()

    async def twice():
        async with _session(client) as session:
            await session.acompletion(messages=HI, max_completion_tokens=5000)
            await session.acompletion(messages=HI, max_completion_tokens=5000)
            return session.last_route.reason

    assert asyncio.run(twice()) == "clamped" and client.refused == 1
