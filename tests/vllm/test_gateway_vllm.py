"""`agentkv gateway` in front of the real vLLM pair, through the OpenAI Python SDK: a conversation past 60% of fast's
window warms slow once, its escalation is routed to slow (proactive) onto the warmed prefix, and text completions
and streams pass through with the route headers."""

from __future__ import annotations

import copy
import time
import uuid

import openai
import pytest

from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.gateway import GatewayConfig, GatewayThread


def turns(tag):
    """The scripted conversation, its system prompt made unique (no other run's cached prefix counts)."""
    agent = ScriptedAgent(result_rows=1)
    messages = agent.opening()
    messages[0]["content"] += f" Run {tag}."
    while True:
        yield copy.deepcopy(messages)
        messages += agent.next_turn()


@pytest.fixture
def gateway(vllm_fast, vllm_slow):
    config = GatewayConfig(fast_url=vllm_fast.base_url, fast_model=vllm_fast.model, slow_url=vllm_slow.base_url,
                           slow_model=vllm_slow.model, port=0)
    with GatewayThread(config) as running:
        yield running


def warm_completed(gateway):
    return sum(s.stats()["warm_completed"] for s in gateway.app.state.ctx.sessions.values())


def test_a_conversation_warms_slow_once_and_escalates_onto_the_warm(gateway, vllm_fast, vllm_slow):
    """Turn at ~1,400 tokens: fast, one warm; turn at ~1,950: slow (proactive) with cached prompt tokens."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="-", max_retries=0)
    conversation = list(zip(range(6), turns(uuid.uuid4())))
    near, past = conversation[2][1], conversation[5][1]  # 1,383 and 1,937 tokens on the real tokenizer
    first = client.chat.completions.with_raw_response.create(model="agentkv", messages=near, tools=TOOLS[:8],
                                                             max_tokens=8)
    assert (first.headers["x-agentkv-backend"], first.headers["x-agentkv-route"]) == ("fast", "fits")
    assert first.parse().model == vllm_fast.model
    deadline = time.monotonic() + 60
    while warm_completed(gateway) < 1:
        assert time.monotonic() < deadline, "the warm never completed"
        time.sleep(0.05)
    second = client.chat.completions.with_raw_response.create(model="agentkv", messages=past, tools=TOOLS[:8],
                                                              max_tokens=8)
    answer = second.parse()
    assert (second.headers["x-agentkv-backend"], second.headers["x-agentkv-route"]) == ("slow", "proactive")
    assert answer.model == vllm_slow.model and answer.usage.prompt_tokens_details.cached_tokens >= 1024
    print("gateway-vllm escalation cached", answer.usage.prompt_tokens_details.cached_tokens, "of",
          answer.usage.prompt_tokens)


def test_text_completions_and_streams_pass_through(gateway, vllm_fast):
    """A text completion and a chat stream through the gateway come from fast with the route headers."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="-", max_retries=0)
    text = client.completions.with_raw_response.create(model="agentkv", prompt=f"{uuid.uuid4()} hello", max_tokens=3)
    assert text.headers["x-agentkv-backend"] == "fast" and text.parse().object == "text_completion"
    stream = client.chat.completions.create(model="agentkv", messages=[{"role": "user", "content": f"{uuid.uuid4()}"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.model for c in chunks} == {vllm_fast.model} and chunks[-1].usage.completion_tokens == 4
