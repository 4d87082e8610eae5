"""The OpenAI Agents SDK with agentkv as its client's httpx transport: routed, warmed, no lost turn.

    python examples/agents_sdk.py [--quick]

``AsyncOpenAI(http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(session)))`` handed to
``OpenAIChatCompletionsModel`` is the one thing to write. The SDK's strict tool schemas are counted
and warmed exactly as sent; a turn the fast server would reject as too long goes to the slow one (and
had it been sent to fast, its overflow would be re-sent to slow: the run never sees the error). The
model's tool calls are scripted (:class:`agentkv.testing.ScriptedTransport`: random-weight models).
"""

from __future__ import annotations

import asyncio

import httpx
from _support import escalation_summary, lookup_script, parse_args, print_ledger, print_stats, quiet_logs, servers
from _support import Servers, storage_logs
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from agentkv import Session
from agentkv.integrations.openai import AsyncAgentKVTransport
from agentkv.testing import ScriptedTransport


@function_tool
def lookup(host: str) -> str:
    """Read the slow-request log of a storage host."""
    return storage_logs(host, 5)


async def run(env: Servers, quick: bool) -> int:
    async with Session(fast=env.fast, slow=env.slow, tenant="acme", cache_salt_secret="example-secret") as s:
        transport = AsyncAgentKVTransport(s, inner=ScriptedTransport(lookup_script(14, "Compaction on osd-03.")))
        client = AsyncOpenAI(base_url=env.fast.api_base, api_key="-",
                             http_client=httpx.AsyncClient(transport=transport))
        agent = Agent(name="sre", instructions="Investigate storage incidents with the tools.", tools=[lookup],
                      model=OpenAIChatCompletionsModel(model=env.fast_server.model_id, openai_client=client),
                      model_settings=ModelSettings(max_tokens=8))
        result = await Runner.run(agent, "Why did disk latency rise overnight?", max_turns=30)
        await s.adrain_warms(60)
        print_ledger(s)
        print_stats(s)
        print(f"final answer: {result.final_output}")
        print(f"agents_sdk: {len(s.ledger)} model calls; {escalation_summary(s, env)}")
    return 0


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    set_tracing_disabled(True)  # the SDK's tracing exporter would call out to api.openai.com
    with servers(args.quick) as env:
        return asyncio.run(run(env, args.quick))


if __name__ == "__main__":
    raise SystemExit(main())
