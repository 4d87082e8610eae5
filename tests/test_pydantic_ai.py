"""pydantic-ai measured: an ``Agent`` with a tool on ``OpenAIChatModel`` over ``AsyncAgentKVTransport``, run async and
streamed, against the embedded servers.

One ``openai.AsyncOpenAI(http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(conversations, ...)))`` serves
the agent; the conversation is found by its opening. The models have random weights, so the tool calls are scripted
after each real request (the answer's message replaced; a stream's chunks replaced, its real usage chunk kept). The
conversation grows past fast's window with a warm fired on the way: no request fast receives overflows its window,
the escalated request runs on slow and reads >= 0.95 of the warm's full blocks (slow's own ``cached_tokens``), and
warm and escalation carry the tenant's salt.
"""

import json
import uuid

import httpx

from agentkv import Backend, Conversations, derive_cache_salt
from agentkv.integrations.openai import AsyncAgentKVTransport
from agentkv.testing import ScriptedTransport
from agent_checks import escalated_request, the_warm, tokenize
from conftest import chat_requests

SECRET = "pydantic-ai-secret"
STEPS = 14
ROWS = "host {i:03d} sdb latency p99 {ms} ms, queue depth {q}, compaction backlog {b} GiB, firmware 2.1.{i}\n"


def lookup_text(topic: str) -> str:
    """A tool result of about 150 tokens."""
    return f"results for {topic}:\n" + "".join(ROWS.format(i=i, ms=40 + i, q=i % 7, b=i * 3) for i in range(6))


def script():
    """Tool calls for STEPS turns, then a final answer."""
    return [[("lookup", json.dumps({"topic": f"disk-{i}"}))] for i in range(STEPS)] + ["It was compaction."]


def sse(payload):
    return f"data: {json.dumps(payload)}\n\n".encode()


def scripted_stream(step, left, model, usage):
    """The SSE an OpenAI-compatible server sends for one scripted step, ending with the real ``usage`` chunk."""
    head = {"id": f"chatcmpl-{left}", "object": "chat.completion.chunk", "created": 0, "model": model}
    if isinstance(step, str):
        delta, finish = {"role": "assistant", "content": step}, "stop"
    else:
        delta, finish = {"role": "assistant", "content": None, "tool_calls": [
            {"index": i, "id": f"call_{left}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(step)]}, "tool_calls"
    chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
    if usage is not None:
        chunks.append({**head, "choices": [], "usage": usage})
    return b"".join(sse(chunk) for chunk in chunks) + b"data: [DONE]\n\n"


class ScriptedStreams(httpx.AsyncBaseTransport):
    """An async transport for streamed agents whose model has random weights: each streamed chat completion goes out
    for real (counts, windows, cache hits stay real), then its chunks are replaced by the script's next step, the
    server's own usage chunk kept. Non-streamed requests (the warms) pass untouched."""

    def __init__(self, steps):
        self.script = list(steps)
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request):
        response = await self._inner.handle_async_request(request)
        body = json.loads(request.content or b"{}")
        if not body.get("stream") or response.status_code != 200 or not self.script:
            return response
        raw = await response.aread()
        await response.aclose()
        usage = None
        for line in raw.decode().splitlines():
            if line.startswith("data: {") and json.loads(line[6:]).get("usage"):
                usage = json.loads(line[6:])["usage"]
        content = scripted_stream(self.script.pop(0), len(self.script), body.get("model"), usage)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=content)

    async def aclose(self):
        await self._inner.aclose()


def conversations(fresh, tenant):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Conversations(fast, slow, tenant=tenant, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                         in_flight=fresh["in_flight"], cache_salt_secret=SECRET)


def agent_over(fresh, convs, inner):
    """A pydantic-ai Agent with one tool, its OpenAIChatModel's AsyncOpenAI client on the agentkv transport."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                         http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(convs, inner=inner)))
    model = OpenAIChatModel(fresh["fast"].model_id, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions=f"Investigate the fleet. Run {uuid.uuid4().hex}.",
                  model_settings={"max_tokens": 8})

    @agent.tool_plain
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return lookup_text(topic)

    return agent


def check_figures(fresh, convs, *, tenant):
    """What the run must show, from the servers' side and the Session's: returns the figures as reported."""
    fast, slow = fresh["fast"], fresh["slow"]
    stats = convs.stats()
    totals = stats["totals"]
    assert stats["conversations"] == 1 and totals["requests_total"] == STEPS + 1  # one run: found by its opening
    assert totals["warm_fired"] == 1 and totals["escalations_after_warm"] == 1 and totals["overflow_errors"] == 0
    fast_bodies = chat_requests(fast)
    assert all(len(tokenize(fast, body)) < fast.max_model_len for body in fast_bodies)  # no overflow reaches fast
    warm, escalation = the_warm(slow), escalated_request(slow)
    salt = derive_cache_salt(SECRET, tenant)
    assert warm["cache_salt"] == escalation["cache_salt"] == salt
    assert all(body["cache_salt"] == salt for body in fast_bodies)
    block = slow.engine.prefix_cache.block_size
    warmed = len(tokenize(slow, warm))
    full = warmed // block * block
    cached = totals["cached_tokens_on_escalation"]  # what slow reported for the escalation
    assert cached >= 0.95 * full, (cached, full)
    return f"{cached} cached / {warmed} warmed ({full} in full blocks)"


async def test_an_agent_run_with_tools_through_the_async_transport(fresh):
    """``await agent.run(...)``: every tool turn answered, the run escalates to slow after the warm, which it reads."""
    async with conversations(fresh, "acme") as convs:
        agent = agent_over(fresh, convs, ScriptedTransport(script()))
        result = await agent.run("Why the latency?")
        await convs.adrain_warms(30)
        figures = check_figures(fresh, convs, tenant="acme")
    assert result.output == "It was compaction."
    print("pydantic-ai run", figures)


async def test_a_streamed_agent_run_through_the_async_transport(fresh):
    """``agent.run_stream_events(...)``: every model request streamed, the same figures, the usage read from the
    stream's last chunk."""
    from pydantic_ai import AgentRunResultEvent

    async with conversations(fresh, "globex") as convs:
        agent = agent_over(fresh, convs, ScriptedStreams(script()))
        async with agent.run_stream_events("Why the latency?") as stream:
            events = [event async for event in stream]
        await convs.adrain_warms(30)
        figures = check_figures(fresh, convs, tenant="globex")
    done = [event for event in events if isinstance(event, AgentRunResultEvent)]
    assert done and done[-1].result.output == "It was compaction."
    assert all(body.get("stream") for body in chat_requests(fresh["fast"]))
    print("pydantic-ai run_stream_events", figures)

