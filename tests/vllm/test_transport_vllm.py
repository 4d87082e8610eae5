"""The OpenAI SDK over agentkv's httpx transports against the real vLLM pair: JSON and streamed answers, sync and
async, usage read from the answer (or the stream's usage chunk), and an unreachable fast failed over to slow."""

from __future__ import annotations

import asyncio
import socket
import uuid

import httpx
import openai
import pytest

from agentkv import Backend, RetryPolicy, Session
from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport


def turn(text: str = "hello") -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{uuid.uuid4()} {text}"}]


def session(fast_url: str, slow, window: int | None = None) -> Session:
    fast = Backend("hosted_vllm/fast", api_base=fast_url, name="fast", window=window)
    return Session(fast, Backend(slow.litellm_model, api_base=slow.base_url, name="slow"),
                   retry=RetryPolicy(initial_s=0.05, max_s=0.2, jitter_s=0.05))


def ask(s: Session, base_url: str, asynchronous: bool, *, stream: bool, messages=None):
    """One chat completion through an OpenAI SDK client over the transport (a stream's chunks collected); the async
    client is made on a loop of its own."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    request = dict(model="fast", messages=messages or turn(), max_tokens=4, **extra)

    async def run():
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-",
                                    http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(s)))
        answer = await client.chat.completions.create(**request)
        return [chunk async for chunk in answer] if stream else answer

    if asynchronous:
        return asyncio.run(run())
    client = openai.OpenAI(base_url=base_url, api_key="-", http_client=httpx.Client(transport=AgentKVTransport(s)))
    answer = client.chat.completions.create(**request)
    return list(answer) if stream else answer


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_json_and_streamed_answers_from_fast_are_recorded_with_their_usage(vllm_fast, vllm_slow, asynchronous):
    """A short turn goes to the real fast vLLM; the JSON answer's usage and the stream's usage chunk (include_usage)
    are what the ledger records, and the stream reaches the caller whole."""
    with session(vllm_fast.base_url, vllm_slow) as s:
        whole = ask(s, vllm_fast.base_url, asynchronous, stream=False)
        assert whole.model == "fast" and whole.usage.completion_tokens >= 1
        assert s.ledger[-1].cached_tokens == whole.usage.prompt_tokens_details.cached_tokens
        chunks = ask(s, vllm_fast.base_url, asynchronous, stream=True)
        assert chunks[0].model == "fast" and chunks[-1].usage.completion_tokens >= 1
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        assert s.ledger[-1].cached_tokens == chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert [row.backend for row in s.ledger] == ["fast", "fast"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_turn_too_long_for_fast_is_sent_to_slow(vllm_fast, vllm_slow, asynchronous):
    """A turn past fast's 2048-token window is routed to the real slow vLLM (its model id in the body), streamed too."""
    long = turn("the quick brown fox jumps over the lazy dog " * 250)
    with session(vllm_fast.base_url, vllm_slow) as s:
        assert ask(s, vllm_fast.base_url, asynchronous, stream=False, messages=long).model == "slow"
        assert ask(s, vllm_fast.base_url, asynchronous, stream=True, messages=long)[0].model == "slow"
    assert [row.backend for row in s.ledger] == ["slow", "slow"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_unreachable_fast_fails_over_to_the_real_slow(vllm_slow, asynchronous):
    """Fast on a port nothing listens on: JSON and streamed turns fail over to the real slow vLLM and are answered."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with session(dead, vllm_slow, window=2048) as s:  # declared: nothing answers /v1/models there
        assert ask(s, dead, asynchronous, stream=False).model == "slow"
        assert ask(s, dead, asynchronous, stream=True)[0].model == "slow"
    assert s.stats()["failovers"] == 2 and [row.backend for row in s.ledger] == ["slow", "slow"]
