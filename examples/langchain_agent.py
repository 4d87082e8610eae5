"""A LangChain tool loop accounted by agentkv: the callback handler, its overflow guard, and the router.

    python examples/langchain_agent.py [--quick]

The chat models are langchain-core's fake models scripted to call a tool (the embedded models' text
is meaningless); the Session counts every call with the fast server's own /tokenize, and its
warm-ahead request really reaches the slow server.

1. ``AgentKVCallbackHandler(session, block_overflow=True)`` observes each call. Once the conversation
   no longer fits the fast model's window it stops the call before it is sent, with a
   ContextOverflowError naming the slow backend: a callback cannot reroute.
2. ``AgentKVRouter(fast_model, slow_model, session)`` is the pattern that does reroute: the rest of
   the loop runs through it and goes to the slow model.
"""

from __future__ import annotations

import logging

from _support import parse_args, print_ledger, print_stats, quiet_logs, servers, storage_logs

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentkv import ContextOverflowError, Session
from agentkv.integrations.langchain import AgentKVCallbackHandler, AgentKVRouter


class ScriptedChat(FakeMessagesListChatModel):
    """A fake chat model with the usual bind_tools."""

    def bind_tools(self, tools, **kwargs):
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)


@tool
def fetch_logs(host: str) -> str:
    """Fetch recent OSD logs of a storage host.

    Args:
        host: The host name.
    """
    return storage_logs(host, 16)


def script(hosts: int) -> list[AIMessage]:
    calls = [AIMessage(content="", tool_calls=[{"name": "fetch_logs", "args": {"host": f"st-eu2-{i:02d}"},
                                                "id": f"call_{i}"}]) for i in range(hosts)]
    return calls + [AIMessage(content="Compaction backlog on sdb; it is over.")]


def step(model, messages, **invoke_kwargs) -> bool:
    """One model call; runs its tool calls; False once the model answers without tools."""
    reply = model.invoke(messages, **invoke_kwargs)
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(ToolMessage(fetch_logs.invoke(call["args"]), tool_call_id=call["id"]))
    return bool(reply.tool_calls)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    logging.getLogger("langchain_core.callbacks.manager").setLevel(logging.CRITICAL)  # we print the block ourselves
    hosts = 4 if args.quick else 6
    with servers(args.quick) as env:
        turns = script(hosts)
        fast_model = ScriptedChat(responses=turns).bind_tools([fetch_logs])
        messages = [SystemMessage("You are an on-call SRE agent."), HumanMessage("Why is eu-west slow?")]
        with Session(fast=env.fast, slow=env.slow, tenant="acme", cache_salt_secret="example-secret") as s:
            handler = AgentKVCallbackHandler(s, block_overflow=True)
            try:
                while step(fast_model, messages, config={"callbacks": [handler]}):
                    print(f"handler: call {len(s.ledger)} observed, {s.ledger[-1].input_tokens} tokens")
            except ContextOverflowError as exc:
                print(f"handler blocked call {len(s.ledger)}: {exc}")
            s.drain_warms(60)
            print(f"warm-ahead requests received by the slow server: {env.warm_requests()}")
            answered = sum(isinstance(m, AIMessage) for m in messages)  # the slow model picks up the script
            slow_model = ScriptedChat(responses=turns[answered:]).bind_tools([fetch_logs])
            router = AgentKVRouter(fast_model, slow_model, s)
            while step(router, messages):
                print(f"router: call {len(s.ledger)} sent to {router.last_role} ({s.ledger[-1].input_tokens} tokens)")
            print(f"router: final answer from the {router.last_role} model: {messages[-1].content}")
        print_ledger(s)
        print_stats(s)
        print(f"langchain_agent: handler counters {handler.counters}; router's last route {router.last_role}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
