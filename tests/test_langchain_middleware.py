"""AgentKVMiddleware and token_counter with LangChain 1.x's real create_agent, ChatOpenAI and the embedded servers.

A scripted tool-calling agent (the embedded models have random weights: the tool calls are scripted after each real
request, streamed answers included) grows past fast's 2048-token window: nothing over the window reaches fast, one
warm fires on the way, the escalation runs on the slow model and reads the warm's blocks from the slow server's
cache, and every request carries the tenant's salt.
"""

import asyncio
import copy
import json
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("langchain.agents")

from langchain.agents import create_agent
from langchain.agents.middleware import SummarizationMiddleware
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import convert_to_messages
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agentkv import Backend, Session
from agentkv.conversations import Conversations
from agentkv.demo.script import SYSTEM_PROMPT, TOOLS, ScriptedAgent
from agentkv.integrations import langchain_agents
from agentkv.integrations.langchain import AgentKVMiddleware, token_counter
from agentkv.testing import ScriptedTransport
from agent_checks import escalated_request, the_warm, tokenize
from conftest import chat_requests

STEPS = 14
ROWS = "host {i:03d} sdb latency p99 {ms} ms, queue depth {q}, compaction backlog {b} GiB, firmware 2.1.{i}\n"
PROMPT = "You are an SRE agent. Investigate with the tools, then answer in one line."


@tool
def lookup(topic: str) -> str:
    """Look up the fleet's records about a topic."""
    return f"results for {topic}:\n" + "".join(ROWS.format(i=i, ms=40 + i, q=i % 7, b=i * 3) for i in range(6))


def script():
    """Tool calls for STEPS turns, then a final answer."""
    return [[("lookup", json.dumps({"topic": f"disk-{i}"}))] for i in range(STEPS)] + ["It was compaction."]


class ScriptedStreams(ScriptedTransport):
    """ScriptedTransport that scripts streamed answers too: the real stream is read whole (the servers count, cache
    and log it), then the script's step is replayed as SSE chunks with the real usage chunk."""

    def handle_request(self, request):
        response = self._inner.handle_request(request)
        if self._streamed(request, response):
            return self._sse(response.read())
        return self._scripted(request, response, lambda r: r.read())

    async def handle_async_request(self, request):
        response = await self._async_inner.handle_async_request(request)
        if self._streamed(request, response):
            return self._sse(await response.aread())
        if self._scriptable(request, response):
            await response.aread()
        return self._scripted(request, response, lambda r: None)

    def _streamed(self, request, response):
        return (bool(self.script) and response.status_code == 200 and request.url.path.endswith("/chat/completions")
                and json.loads(request.content or b"{}").get("stream"))

    def _sse(self, raw):
        lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
        usage = [json.loads(line) for line in lines if json.loads(line).get("usage")]
        step, n = self.script.pop(0), len(self.script)
        if isinstance(step, str):
            delta, finish = {"role": "assistant", "content": step}, "stop"
        else:
            delta, finish = {"role": "assistant", "content": None, "tool_calls": [
                {"index": i, "id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(step)]}, "tool_calls"
        head = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 0, "model": "scripted"}
        chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}, *usage]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(body.encode()))


def make_session(fresh, **kwargs):
    """A tenant's Session over the servers, their tokenizer and template declared (exact counts, no /tokenize)."""
    return Session(fresh["fast"].backend(name="fast"), fresh["slow"].backend(name="slow"), discovery=fresh["discovery"],
                   cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"], session_id=fresh["session_id"],
                   tenant=fresh["session_id"], cache_salt_secret="k", **kwargs)  # a tenant per test: its own cache


def chat(server, transport, **kwargs):
    return ChatOpenAI(model=server.model_id, base_url=server.api_base, api_key="-", max_tokens=8, max_retries=0,
                      stream_usage=True, http_client=httpx.Client(transport=transport),
                      http_async_client=httpx.AsyncClient(transport=transport), **kwargs)


def agent_for(fresh, target, transport):
    middleware = AgentKVMiddleware(target, slow=chat(fresh["slow"], transport))
    return create_agent(model=chat(fresh["fast"], transport), tools=[lookup], system_prompt=PROMPT,
                        middleware=[middleware])


RUN = {"configurable": {"thread_id": "incident-7"}, "recursion_limit": 100}
TASK = {"messages": [("user", "Why the latency?")]}


def user_of(body):
    """The first user message of a request body (which conversation it belongs to)."""
    return next((m["content"] for m in body.get("messages", ()) if m["role"] == "user"), None)


def check_run(fresh, s, task=None):
    """Nothing over fast's window reached fast; one warm, the escalation on slow reading >= 95% of the warm's full
    blocks; warm, escalation and fast turns carry the tenant's salt. ``task``: the conversation's first user message
    (None: the servers saw one conversation). Returns (cached, the warm's full-block tokens, the warm's tokens)."""
    fast, slow = fresh["fast"], fresh["slow"]
    sent = [b for b in chat_requests(fast) if task is None or user_of(b) == task]
    assert all(len(tokenize(fast, b)) + b.get("max_completion_tokens", b.get("max_tokens", 0)) <= 2048 for b in sent)
    stats = s.stats()
    assert stats["warm_fired"] == 1 and stats["escalations"] == 1 and stats["overflow_errors"] == 0
    assert stats["escalations_after_warm"] == 1
    assert len(s.ledger) == STEPS + 1 and s.ledger[-1].backend == "slow"
    if task is None:
        warm, escalation = the_warm(slow), escalated_request(slow)
    else:
        warm, escalation = (next(b for b in chat_requests(slow) if user_of(b) == task and pick(b))
                            for pick in (lambda b: b.get("max_tokens") == 1, lambda b: b.get("max_tokens") != 1))
    assert escalation["model"] == slow.model_id and escalation["tools"] == warm["tools"]
    assert {warm["cache_salt"], escalation["cache_salt"], *(b["cache_salt"] for b in sent)} == {s._parts.cache_salt}
    block = slow.engine.prefix_cache.block_size
    warmed = len(tokenize(slow, warm))
    full = warmed // block * block
    cached = next(row for row in s.ledger if row.backend == "slow").cached_tokens
    assert cached >= 0.95 * full, (cached, full)
    return cached, full, warmed


def test_create_agent_invoke_routes_warms_and_escalates(fresh):
    """agent.invoke: fast while it fits, one warm at 60%, the escalation on slow reading the warm's blocks, salted."""
    with make_session(fresh) as s:
        result = agent_for(fresh, s, ScriptedStreams(script())).invoke(TASK, RUN)
        assert s.drain_warms(30)
    assert result["messages"][-1].content == "It was compaction."
    print("create_agent invoke: cached / warm's full blocks / warm", check_run(fresh, s))


async def test_create_agent_ainvoke_routes_warms_and_escalates(fresh):
    """agent.ainvoke: the async twin routes, warms (as a task), escalates and salts the same way."""
    async with make_session(fresh) as s:
        result = await agent_for(fresh, s, ScriptedStreams(script())).ainvoke(TASK, RUN)
        await s.adrain_warms(30)
    assert result["messages"][-1].content == "It was compaction."
    print("create_agent ainvoke: cached / warm's full blocks / warm", check_run(fresh, s))


def test_create_agent_streamed_messages_still_route(fresh, monkeypatch):
    """agent.stream(stream_mode="messages"): each model call streams through the middleware, and routes the same."""
    seen, real = [], langchain_agents.streams

    def streams(request):
        seen.append(real(request))
        return seen[-1]

    monkeypatch.setattr(langchain_agents, "streams", streams)
    with make_session(fresh) as s:
        chunks = list(agent_for(fresh, s, ScriptedStreams(script())).stream(TASK, RUN, stream_mode="messages"))
        assert s.drain_warms(30)
    text = "".join(c.content for c, meta in chunks if meta.get("langgraph_node") == "model" and isinstance(c.content, str))
    assert text.endswith("It was compaction.") and seen == [True] * (STEPS + 1)
    assert all(b.get("stream") for b in chat_requests(fresh["fast"]))
    print("create_agent stream: cached / warm's full blocks / warm", check_run(fresh, s))


def test_a_fast_overflow_is_re_sent_to_slow(fresh):
    """When fast's window shrinks under the Session's feet, its 400 never reaches the agent: the call runs on slow."""
    transport = ScriptedStreams(script()[10:])
    with make_session(fresh) as s:
        agent = agent_for(fresh, s, transport)
        history = agent.invoke(TASK, {"recursion_limit": 100})["messages"][:-1]
        fresh["fast"].max_model_len = 600  # discovery still holds 2048
        transport.script = ["after the overflow"]
        result = agent.invoke({"messages": history}, {"recursion_limit": 100})
        assert s.drain_warms(30)
    assert result["messages"][-1].content == "after the overflow"
    assert s.stats()["reactive_escalations"] == 1 and s.ledger[-1].backend == "slow"


class ByTask(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """A scripted transport per conversation, picked by the request's first user message."""

    def __init__(self, tasks):
        self.by = {task: ScriptedStreams(script()) for task in tasks}

    def handle_request(self, request):
        return self.by[user_of(json.loads(request.content))].handle_request(request)

    async def handle_async_request(self, request):
        return await self.by[user_of(json.loads(request.content))].handle_async_request(request)


@dataclass
class Caller:
    """The run's context: who is calling (what an integrator's tenant_of reads, never the messages)."""

    tenant: str


def conversations(fresh, **kwargs):
    return Conversations(fresh["fast"].backend(name="fast"), fresh["slow"].backend(name="slow"),
                         discovery=fresh["discovery"], cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"],
                         cache_salt_secret="k", **kwargs)


async def test_one_middleware_serves_interleaved_threads_of_two_tenants(fresh):
    """One agent and one middleware over a Conversations: two threads of two tenants run at once, each on its own
    Session (by thread_id, its tenant from the run's context), each warm salted with its tenant's salt and read by
    its own escalation; neither conversation reads the other's cache."""
    tenants = {"a": f"{fresh['session_id']}-1", "b": f"{fresh['session_id']}-2"}
    tasks = {"a": "Why the latency on eu-west?", "b": "Why the latency on us-east?"}
    transport = ByTask(tasks.values())
    async with conversations(fresh, tenant_of=lambda request: request.runtime.context.tenant) as convs:
        middleware = AgentKVMiddleware(convs, slow=chat(fresh["slow"], transport))
        agent = create_agent(model=chat(fresh["fast"], transport), tools=[lookup], system_prompt=PROMPT,
                             middleware=[middleware], context_schema=Caller)
        results = await asyncio.gather(*(agent.ainvoke(
            {"messages": [("user", tasks[t])]}, {"configurable": {"thread_id": t}, "recursion_limit": 100},
            context=Caller(tenants[t])) for t in tasks))
        await convs.adrain_warms(30)
        held = convs.stats()["sessions"]
        sessions = {t: convs.session_for(t, request=SimpleNamespace(runtime=SimpleNamespace(context=Caller(tenants[t]))))
                    for t in tasks}
    assert [r["messages"][-1].content for r in results] == ["It was compaction."] * 2
    assert sorted(held) == sorted(f"{tenants[t]}/h:{t}" for t in tasks)
    assert sessions["a"]._parts.cache_salt != sessions["b"]._parts.cache_salt
    for t, s in sessions.items():
        assert s.tenant == tenants[t] and s.ledger[0].cached_tokens == 0  # not even the shared prompt: other salt
        print(f"Conversations, thread {t}: cached / warm's full blocks / warm", check_run(fresh, s, tasks[t]))


def test_a_thread_keeps_its_session_when_the_summarizer_replaces_the_history(fresh):
    """With a thread_id the conversation keeps its Session when SummarizationMiddleware (counting with agentkv's
    token_counter) replaces the history; without one, the new opening is a new conversation."""
    held = []
    for run in ({"configurable": {"thread_id": "t-1"}, "recursion_limit": 100}, {"recursion_limit": 100}):
        with conversations(fresh, tenant=fresh["session_id"]) as convs:
            transport = ScriptedStreams(script()[6:])
            summarize = SummarizationMiddleware(
                FakeListChatModel(responses=["the disks were slow"]), trigger=("tokens", 900), keep=("messages", 4),
                token_counter=token_counter(convs, tools=[lookup], system_prompt=PROMPT))
            agent = create_agent(model=chat(fresh["fast"], transport), tools=[lookup], system_prompt=PROMPT,
                                 middleware=[summarize, AgentKVMiddleware(convs, slow=chat(fresh["slow"], transport))])
            result = agent.invoke(TASK, run)
            held.append(convs.stats())
        assert "the disks were slow" in result["messages"][0].content  # the history was replaced
    assert held[0]["conversations"] == 1 and held[0]["totals"]["requests"] == {"fast": STEPS - 5}
    assert held[1]["conversations"] > 1


def test_hosted_models_never_get_a_salt():
    """call_settings puts the tenant's salt in extra_body for a self-hosted backend and removes it for a hosted one."""
    from agentkv.routing import RouteDecision

    class Try:
        decision = RouteDecision("fast", "fast", "fits", 100, 2048, 8)
        kwargs, handoff_export, routing_key, headers, send_headers = {}, None, None, {}, {}
        cache_salt = "salt-acme"

    model = ChatOpenAI(model="m", api_key="-", extra_body={"cache_salt": "callers", "top_k": 5})
    for backend, salt in ((Backend("hosted_vllm/m", api_base="http://h:8000/v1"), "salt-acme"),
                          (Backend("gpt-5-mini"), None)):
        Try.backend = backend
        extra = langchain_agents.call_settings(Try(), model, {})["extra_body"]
        assert extra.get("cache_salt") == salt and extra["top_k"] == 5


# ----------------------------------------------------------------------------- the token counter
def conversation(turns):
    """The scripted SRE agent's messages after ``turns`` tool turns (no system message: the agent's state)."""
    agent, msgs = ScriptedAgent(result_rows=3), []
    for _ in range(turns):
        msgs += agent.next_turn()
    return convert_to_messages(copy.deepcopy([ScriptedAgent().opening()[1], *msgs]))


def exact_count(fast, messages):
    """The fast server's own count of the agent's request: system prompt, messages, the 20 tool schemas."""
    wire = langchain_agents.wire_messages(messages)
    return len(tokenize(fast, {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, *wire], "tools": TOOLS}))


def fires(middleware, messages):
    """Whether SummarizationMiddleware summarizes before a model call on ``messages``."""
    return middleware.before_model({"messages": list(messages)}, None) is not None


def test_token_counter_is_exact_without_http_and_fires_where_the_exact_count_crosses(fresh):
    """agentkv's counter equals the server's count (tools and system prompt included) without a request, and
    SummarizationMiddleware fires on it exactly where the exact count crosses the trigger; LangChain's default
    counter fires elsewhere on the same tool-heavy conversation."""
    trigger, turns = 4000, 30
    with make_session(fresh) as s:
        counter = token_counter(s, tools=TOOLS, system_prompt=SYSTEM_PROMPT)
        fresh["fast"].clear_requests()
        ours = [counter(conversation(n)) for n in range(turns)]
        assert fresh["fast"].requests == []  # no /tokenize, no HTTP at all
        exact = [exact_count(fresh["fast"], conversation(n)) for n in range(turns)]
        assert ours == exact
        summarizer = FakeListChatModel(responses=["summary"] * 4)
        agentkv_mw = SummarizationMiddleware(summarizer, trigger=("tokens", trigger), keep=("messages", 2),
                                             token_counter=counter)
        default_mw = SummarizationMiddleware(summarizer, trigger=("tokens", trigger), keep=("messages", 2))
        ours_at = next(n for n in range(turns) if fires(agentkv_mw, conversation(n)))
        default_at = next((n for n in range(turns) if fires(default_mw, conversation(n))), None)
    crossing = next(n for n in range(turns) if exact[n] >= trigger)
    assert ours_at == crossing and default_at != crossing
    approx = [count_tokens_approximately(conversation(n)) for n in range(turns)]
    print(f"trigger {trigger}: agentkv fires at turn {ours_at} (exact {exact[ours_at]}), default at turn {default_at} "
          f"(its count {approx[default_at] if default_at is not None else None}, exact "
          f"{exact[default_at] if default_at is not None else None})")


def test_token_counter_estimates_within_its_bound_without_a_declared_tokenizer(fresh):
    """Without a declared tokenizer the counter gives the Session's local estimate (no /tokenize either), close to
    the server's count."""
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    with Session(fast, discovery=fresh["discovery"], session_id=fresh["session_id"]) as s:
        counter = token_counter(s, tools=TOOLS, system_prompt=SYSTEM_PROMPT)
        fresh["fast"].clear_requests()
        estimate = counter(conversation(8))
        assert fresh["fast"].requests == []
    exact = exact_count(fresh["fast"], conversation(8))
    assert abs(estimate - exact) <= 0.15 * exact


def test_token_counter_converts_each_message_once(monkeypatch):
    """Counting a growing conversation again and again converts each message once (LangChain calls the counter
    many times per decision, on suffixes too)."""
    converted = []
    real = langchain_agents._wire_message
    monkeypatch.setattr(langchain_agents, "_wire_message", lambda m: converted.append(m) or real(m))
    messages = conversation(6)
    with Session(Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", tokenizer="cl100k_base")) as s:
        counter = token_counter(s, tools=TOOLS)
        for start in range(len(messages)):
            counter(messages[start:])
            counter(messages)
    assert len(converted) == len(messages)


def test_a_response_format_is_counted_and_warmed_with_its_tool(fresh):
    """create_agent(response_format=...): the structured-output tool it binds is counted and warmed with the rest, so
    the escalation reads the warm (and the structured response comes back)."""
    from pydantic import BaseModel

    class Verdict(BaseModel):
        """The cause of the incident."""

        cause: str

    steps = script()[:-1] + [[("Verdict", '{"cause": "compaction"}')]]
    with make_session(fresh) as s:
        transport = ScriptedStreams(steps)
        agent = create_agent(model=chat(fresh["fast"], transport), tools=[lookup], system_prompt=PROMPT,
                             response_format=Verdict, middleware=[AgentKVMiddleware(s, slow=chat(fresh["slow"], transport))])
        result = agent.invoke(TASK, RUN)
        assert s.drain_warms(30)
    assert result["structured_response"] == Verdict(cause="compaction")
    assert [t["function"]["name"] for t in the_warm(fresh["slow"])["tools"]] == ["lookup", "Verdict"]
    print("create_agent response_format: cached / warm's full blocks / warm", check_run(fresh, s))
