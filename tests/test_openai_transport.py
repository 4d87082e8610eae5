"""The httpx transports under the real openai SDK (sync, async, streaming) against the embedded servers."""

import copy

import httpx
import openai

from agentkv import Backend, Session
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport
from agentkv.wire.openai import UsageWatch
from agent_checks import check_escalation
from conftest import chat_requests

TOOLS8 = TOOLS[:8]


def make_session(fresh, **kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"],
                   session_id=fresh["session_id"], tenant=fresh["session_id"], cache_salt_secret="k", **kwargs)


def conversation():
    """The scripted agent's messages, turn after turn (the model's tool calls are scripted)."""
    agent = ScriptedAgent(result_rows=1)
    messages = agent.opening()
    while True:
        yield copy.deepcopy(messages)
        messages += agent.next_turn()


def cached(usage):
    return usage.prompt_tokens_details.cached_tokens


def test_sync_client_escalates_onto_a_warm_prefix(fresh):
    """openai.OpenAI over AgentKVTransport: every turn answered, one warm at 60%, the escalation >= 80% cached."""
    with make_session(fresh) as s:
        client = openai.OpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                               http_client=httpx.Client(transport=AgentKVTransport(s)))
        for messages in conversation():
            answer = client.chat.completions.create(model=fresh["fast"].model_id, messages=messages, tools=TOOLS8,
                                                    max_tokens=8)
            if s.last_route.role == "slow":
                break
            assert s.drain_warms(30)
        assert answer.model == fresh["slow"].model_id and s.ledger[-1].cached_tokens == cached(answer.usage)
    print("openai-sync", check_escalation(s, fresh["slow"], cached(answer.usage)))
    assert all(b.get("cache_salt") == s._parts.cache_salt for b in chat_requests(fresh["slow"]) + chat_requests(fresh["fast"]))
    assert s.stats()["cached_tokens_on_escalation"] == cached(answer.usage) > 0


async def test_async_streaming_client_escalates_onto_a_warm_prefix(fresh):
    """openai.AsyncOpenAI streaming over AsyncAgentKVTransport: usage comes from the stream's last chunk."""
    async with make_session(fresh) as s:
        client = openai.AsyncOpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(s)))
        for messages in conversation():
            stream = await client.chat.completions.create(
                model=fresh["fast"].model_id, messages=messages, tools=TOOLS8, max_tokens=8, stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            if s.last_route.role == "slow":
                break
            await s.adrain_warms(30)
        usage = chunks[-1].usage
    assert chunks[0].model == fresh["slow"].model_id and s.ledger[-1].cached_tokens == cached(usage)
    print("openai-async-stream", check_escalation(s, fresh["slow"], cached(usage)))


def test_a_fast_overflow_is_resent_to_slow_and_the_caller_sees_one_answer(fresh):
    """When fast's real window is smaller than the one declared, its overflow 400 is resent to slow, streaming too."""
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast", window=8192)
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    long = next(m for i, m in enumerate(conversation()) if i == 12)
    with Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                 in_flight=fresh["in_flight"], session_id=fresh["session_id"]) as s:
        client = openai.OpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                               http_client=httpx.Client(transport=AgentKVTransport(s)))
        whole = client.chat.completions.create(model=fresh["fast"].model_id, messages=long, max_tokens=8)
        streamed = list(client.chat.completions.create(model=fresh["fast"].model_id, messages=long, max_tokens=8,
                                                       stream=True))
        assert s.drain_warms(30)
    assert whole.model == streamed[0].model == fresh["slow"].model_id
    assert s.stats()["overflow_errors"] >= 1 and s.stats()["reactive_fallbacks"] >= 1
    assert [row.backend for row in s.ledger] == ["slow", "slow"]


def test_other_paths_pass_through_untouched(fresh):
    """GET /models goes to the server the client named, unrouted and unrecorded."""
    with make_session(fresh) as s:
        client = openai.OpenAI(base_url=fresh["fast"].api_base, api_key="-",
                               http_client=httpx.Client(transport=AgentKVTransport(s)))
        assert [m.id for m in client.models.list()] == [fresh["fast"].model_id] and s.ledger == []


def test_the_usage_watch_reads_split_sse_lines():
    """The usage chunk is found even when a line arrives in pieces; other chunks are ignored."""
    watch = UsageWatch()
    for piece in (b'data: {"choices": []}\n\ndata: {"choices": [], "us', b'age": {"prompt_tokens": 3}}\n\n',
                  b"data: [DONE]\n\n"):
        watch.feed(piece)
    assert watch.usage_chunk == {"choices": [], "usage": {"prompt_tokens": 3}}
