"""Real agent frameworks over the transport: ChatOpenAI + LangGraph, ChatAgentKV, and the OpenAI Agents SDK.

Each drives a scripted tool-calling agent (the embedded models have random weights, so the tool calls
are scripted by :class:`agentkv.testing.ScriptedTransport` after each real request) past the fast
window: no turn is lost, nothing overflows at fast, one warm fires at 60%, and the escalation finds
at least 80% of the warm's tokens cached, as the slow server reports.
"""

import json

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agentkv import Backend, Session
from agentkv.integrations.langchain import ChatAgentKV
from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport
from agentkv.testing import ScriptedTransport
from agent_checks import check_escalation

STEPS = 14
ROWS = "host {i:03d} sdb latency p99 {ms} ms, queue depth {q}, compaction backlog {b} GiB, firmware 2.1.{i}\n"


def lookup_text(topic: str) -> str:
    """A tool result of about 150 tokens."""
    return f"results for {topic}:\n" + "".join(ROWS.format(i=i, ms=40 + i, q=i % 7, b=i * 3) for i in range(6))


def script():
    """Tool calls for STEPS turns, then a final answer."""
    return [[("lookup", json.dumps({"topic": f"disk-{i}"}))] for i in range(STEPS)] + ["It was compaction."]


def make_session(fresh):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"],
                   session_id=fresh["session_id"], tenant=fresh["session_id"], cache_salt_secret="k")


def first_slow_row(session):
    return next(row for row in session.ledger if row.backend == "slow")


def test_langgraph_react_agent_on_chatopenai_through_the_transport(fresh):
    """create_react_agent over ChatOpenAI(http_client=AgentKVTransport): every turn answered, the escalation warm."""
    from langgraph.prebuilt import create_react_agent

    @tool
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return lookup_text(topic)

    with make_session(fresh) as s:
        transport = AgentKVTransport(s, inner=ScriptedTransport(script()))
        model = ChatOpenAI(model=fresh["fast"].model_id, base_url=fresh["fast"].api_base, api_key="-", max_tokens=8,
                           max_retries=0, http_client=httpx.Client(transport=transport))
        result = create_react_agent(model, [lookup]).invoke({"messages": [("user", "Why the latency?")]},
                                                            {"recursion_limit": 100})
        assert s.drain_warms(30)
    assert result["messages"][-1].content == "It was compaction." and len(s.ledger) == STEPS + 1
    print("langgraph+ChatOpenAI", check_escalation(s, fresh["slow"], first_slow_row(s).cached_tokens))


def test_chat_agentkv_streams_and_structures_under_langgraph(fresh):
    """ChatAgentKV over two ChatOpenAI models: a LangGraph agent with response_format, then token streaming."""
    from langgraph.prebuilt import create_react_agent
    from pydantic import BaseModel

    class Verdict(BaseModel):
        cause: str

    @tool
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return lookup_text(topic)

    steps = script()[:-1] + ["done", [("Verdict", '{"cause": "compaction"}')]]
    with make_session(fresh) as s:
        scripted = ScriptedTransport(steps)

        def chat(server):
            return ChatOpenAI(model=server.model_id, base_url=server.api_base, api_key="-", max_tokens=8,
                              max_retries=0, http_client=httpx.Client(transport=scripted))

        router = ChatAgentKV(chat(fresh["fast"]), chat(fresh["slow"]), s)
        result = create_react_agent(router, [lookup], response_format=Verdict).invoke(
            {"messages": [("user", "Why the latency?")]}, {"recursion_limit": 100})
        assert s.drain_warms(30)
        chunks = list(router.stream(result["messages"]))
    assert result["structured_response"] == Verdict(cause="compaction") and router.last_role == "slow"
    assert len(chunks) > 1 and s.stats()["escalations"] == 1
    print("ChatAgentKV", check_escalation(s, fresh["slow"], first_slow_row(s).cached_tokens))


async def test_openai_agents_sdk_through_the_async_transport(fresh):
    """The Agents SDK's AsyncOpenAI over AsyncAgentKVTransport: strict tool schemas, the run completes, the warm pays."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return lookup_text(topic)

    async with make_session(fresh) as s:
        transport = AsyncAgentKVTransport(s, inner=ScriptedTransport(script()))
        client = AsyncOpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                             http_client=httpx.AsyncClient(transport=transport))
        agent = Agent(name="sre", instructions="Investigate.", tools=[lookup], model_settings=ModelSettings(max_tokens=8),
                      model=OpenAIChatCompletionsModel(model=fresh["fast"].model_id, openai_client=client))
        result = await Runner.run(agent, "Why the latency?", max_turns=STEPS + 2)
        await s.adrain_warms(30)
    assert result.final_output == "It was compaction." and len(s.ledger) == STEPS + 1
    warm = [b for b in fresh["slow"].requests if (b.body or {}).get("max_tokens") == 1][0].body
    assert warm["tools"][0]["function"]["strict"] is True  # the schema as the SDK sent it, byte for byte
    print("agents-sdk", check_escalation(s, fresh["slow"], first_slow_row(s).cached_tokens))
