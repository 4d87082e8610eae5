"""LangChain 1.x create_agent with AgentKVMiddleware: every model call counted, routed, warmed and salted.

    python examples/langchain_middleware.py [--quick]

``create_agent(model=fast, tools=tools, middleware=[AgentKVMiddleware(convs, slow=slow)])`` is the one thing to
write. The middleware sees each model call of the agent; the conversation is the run's LangGraph ``thread_id``. It
counts the call as ChatOpenAI sends it (system prompt, messages, tool schemas), keeps it on the fast model while it
fits, fires a warm at 60% of fast's window, and runs the call on the slow model once it no longer fits, where the
warm has prefilled its prefix. ``token_counter(convs, tools=..., system_prompt=...)`` gives LangChain's
``SummarizationMiddleware`` the same exact count, without HTTP; a second thread summarizes with it instead of
escalating. The model's tool calls are scripted (:class:`agentkv.testing.ScriptedTransport`: random-weight models).
"""

from __future__ import annotations

from typing import Any

import httpx
from _support import lookup_script, parse_args, quiet_logs, servers, storage_logs
from langchain.agents import create_agent
from langchain.agents.middleware import SummarizationMiddleware
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agentkv import Conversations
from agentkv.integrations.langchain import AgentKVMiddleware, token_counter
from agentkv.testing import ScriptedTransport

PROMPT = "You are an on-call SRE agent. Investigate with the tools, then answer in one line."
TASK = {"messages": [("user", "Why did disk latency rise overnight?")]}


@tool
def lookup(host: str) -> str:
    """Read the slow-request log of a storage host."""
    return storage_logs(host, 5)


def chat(server, transport: ScriptedTransport) -> ChatOpenAI:
    return ChatOpenAI(model=server.model_id, base_url=server.api_base, api_key="-", max_tokens=8, max_retries=0,
                      http_client=httpx.Client(transport=transport))


def agent_on(env, convs: Conversations, steps: int, *middleware: Any) -> Any:
    """A create_agent agent on the fast model, its calls routed by AgentKVMiddleware (after ``middleware``)."""
    transport = ScriptedTransport(lookup_script(steps, "Compaction on osd-03."))
    routed = AgentKVMiddleware(convs, slow=chat(env.slow_server, transport))
    return create_agent(model=chat(env.fast_server, transport), tools=[lookup], system_prompt=PROMPT,
                        middleware=[*middleware, routed])


def warm_read(session: Any, block: int) -> str:
    """How much of its warm the escalated call read: slow's cached_tokens against the warm's full blocks."""
    fired = next(row for row in session.ledger if row.warm == "fire")
    row = next(row for row in session.ledger if row.backend == "slow")
    full = fired.input_tokens // block * block
    return (f"the escalation at call {row.turn} ({row.input_tokens} tokens) read {row.cached_tokens} cached tokens, "
            f"{row.cached_tokens / full:.0%} of the warm's {full} full-block tokens (warm fired at call {fired.turn})")


def summarized(env, convs: Conversations, counter: Any, steps: int) -> str:
    """The same task on another thread, with SummarizationMiddleware counting on agentkv's token_counter."""
    summarizer = SummarizationMiddleware(FakeListChatModel(responses=["Summary: osd hosts blocked on sdb."] * 9),
                                         trigger=("tokens", 1200), keep=("messages", 4), token_counter=counter)
    result = agent_on(env, convs, steps, summarizer).invoke(TASK, {"configurable": {"thread_id": "incident-8"},
                                                                  "recursion_limit": 100})
    summaries = sum("Summary: osd hosts" in str(m.content) for m in result["messages"])
    routes = convs.session_for("incident-8").stats()["requests"]
    return f"with SummarizationMiddleware(token_counter=...) at 1200 tokens: {summaries} summary, routes {routes}"


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    steps = 14 if args.quick else 20
    with servers(args.quick) as env:
        fast, slow = env.fast_server.backend(name="fast"), env.slow_server.backend(name="slow")  # exact counts
        with Conversations(fast, slow, tenant="acme", cache_salt_secret="example-secret") as convs:
            result = agent_on(env, convs, steps).invoke(TASK, {"configurable": {"thread_id": "incident-7"},
                                                               "recursion_limit": 100})
            convs.drain_warms(60)  # only so the demo's numbers do not depend on timing
            session = convs.session_for("incident-7")  # the thread's Session
            print(f"final answer: {result['messages'][-1].content}")
            print("routes: " + " ".join(row.backend for row in session.ledger))
            counter = token_counter(convs, tools=[lookup], system_prompt=PROMPT)
            history = result["messages"][:-1]  # what the last call sent
            print(f"the last call's messages: token_counter {counter(history)}, the ledger "
                  f"{session.ledger[-1].input_tokens} (as sent, tools included), LangChain's default counter "
                  f"{count_tokens_approximately(history)}")
            print(f"langchain_middleware: routes {session.stats()['requests']}; "
                  f"{warm_read(session, env.slow_server.engine.prefix_cache.block_size)}; "
                  f"{summarized(env, convs, counter, steps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
