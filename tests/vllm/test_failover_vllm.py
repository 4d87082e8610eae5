"""A real vLLM killed mid-conversation: the next turn fails over to slow and is answered, whichever client sends it.

The fast server is the test's own (``disposable_fast``), SIGKILLed between turns; slow is the tier's. Through
litellm's ``hosted_vllm`` provider the dead server's refused connection arrives as ``InternalServerError``
(status 500), through the OpenAI SDK as ``APIConnectionError``: the Session decides from the errno underneath.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai

from agentkv import Backend, RetryPolicy, Session
from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport
from agentkv.retry import outage_cause
from agentkv.testing import capture_events


def turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{uuid.uuid4()} {text}"}]


def test_a_fast_vllm_killed_between_turns_fails_over_to_slow_for_every_client(disposable_fast, vllm_slow):
    """Turn 1 is answered by fast; fast is SIGKILLed; what litellm (sync and async), the OpenAI SDK and httpx raise for
    it all read as a refused connection, and the next turns (litellm sync and async, the OpenAI SDK over the
    transport, JSON and streamed) each fail over to slow after the policy's tries and are answered.

    One test, one server start: a disposable vLLM takes 20 s or more to start here."""
    fast = Backend("hosted_vllm/fast", api_base=disposable_fast.base_url, name="fast")
    slow = Backend(vllm_slow.litellm_model, api_base=vllm_slow.base_url, name="slow")
    quick = RetryPolicy(attempts=3, initial_s=0.05, max_s=0.2, jitter_s=0.05)
    with Session(fast, slow, retry=quick) as s:
        s.completion(messages=turn("hello"), max_tokens=4)
        assert s.last_route.role == "fast"
        disposable_fast.kill()
        assert not disposable_fast.alive
        assert [outage_cause(e) for e in raised_by_each_client(disposable_fast.base_url)] == ["refused"] * 4

        with capture_events() as events:
            answer = s.completion(messages=turn("are you there?"), max_tokens=4)
        assert answer.model.endswith("slow") and s.last_route.reason == "failover"
        failover = next(e for e in events if e["event"] == "failover")
        assert failover["error"] == "InternalServerError" and failover["cause"] == "refused"

        answer = asyncio.run(s.acompletion(messages=turn("still there?"), max_tokens=4))
        assert answer.model.endswith("slow") and s.last_route.reason == "failover"

        sdk = openai.OpenAI(base_url=disposable_fast.base_url, api_key="-",
                            http_client=httpx.Client(transport=AgentKVTransport(s)))
        answer = sdk.chat.completions.create(model="fast", messages=turn("and now?"), max_tokens=4)
        assert answer.model == "slow" and s.last_route.reason == "failover"

        async def streamed():
            client = openai.AsyncOpenAI(base_url=disposable_fast.base_url, api_key="-",
                                        http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(s)))
            chunks = await client.chat.completions.create(model="fast", messages=turn("last one"), max_tokens=4,
                                                          stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in chunks]

        chunks = asyncio.run(streamed())
        assert chunks[0].model == "slow" and chunks[-1].usage.prompt_tokens > 0
    assert s.stats()["failovers"] == 4 and [row.backend for row in s.ledger] == ["fast"] + ["slow"] * 4


def raised_by_each_client(base: str) -> list[BaseException]:
    """What litellm (sync, async), the OpenAI SDK and httpx raise for one chat completion to ``base``."""
    import litellm

    messages = turn("hi")
    errors = []
    for send in (
        lambda: litellm.completion(model="hosted_vllm/fast", api_base=base, messages=messages, max_tokens=4,
                                   num_retries=0, max_retries=0),
        lambda: asyncio.run(litellm.acompletion(model="hosted_vllm/fast", api_base=base, messages=messages,
                                                max_tokens=4, num_retries=0, max_retries=0)),
        lambda: openai.OpenAI(base_url=base, api_key="-", max_retries=0).chat.completions.create(
            model="fast", messages=messages, max_tokens=4),
        lambda: httpx.post(base + "/chat/completions", json={"model": "fast", "messages": messages}),
    ):
        try:
            send()
        except Exception as error:  # noqa: BLE001 - the error is what the test inspects
            errors.append(error)
    return errors
