"""A LangGraph ReAct agent on ChatOpenAI, routed by agentkv through the model's httpx client.

    python examples/langgraph_agent.py [--quick]

``ChatOpenAI(http_client=httpx.Client(transport=AgentKVTransport(session)))`` is the one thing to
write: LangGraph's ``create_react_agent`` calls the model as usual; agentkv counts each request as
ChatOpenAI sends it, moves the conversation to the slow server once it outgrows the fast window,
salts it for the tenant and warms the slow server's prefix cache ahead of the move. The model's tool
calls are scripted (:class:`agentkv.testing.ScriptedTransport`: random-weight models); the tool runs.
"""

from __future__ import annotations

import httpx
from _support import escalation_summary, lookup_script, parse_args, print_ledger, print_stats, quiet_logs, servers
from _support import storage_logs
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from agentkv import Session
from agentkv.integrations.openai import AgentKVTransport
from agentkv.testing import ScriptedTransport


@tool
def lookup(host: str) -> str:
    """Read the slow-request log of a storage host."""
    return storage_logs(host, 5)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    with servers(args.quick) as env, Session(fast=env.fast, slow=env.slow, tenant="acme",
                                             cache_salt_secret="example-secret") as s:
        transport = AgentKVTransport(s, inner=ScriptedTransport(lookup_script(14, "Compaction on osd-03.")))
        model = ChatOpenAI(model=env.fast_server.model_id, base_url=env.fast.api_base, api_key="-", max_tokens=8,
                           http_client=httpx.Client(transport=transport))
        agent = create_react_agent(model, [lookup])
        result = agent.invoke({"messages": [("user", "Why did disk latency rise overnight?")]},
                              {"recursion_limit": 100})
        s.drain_warms(60)
        print_ledger(s)
        print_stats(s)
        print(f"final answer: {result['messages'][-1].content}")
        print(f"langgraph_agent: {len(s.ledger)} model calls; {escalation_summary(s, env)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
