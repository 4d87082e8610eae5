"""The official openai SDK with agentkv as its httpx transport: one line, and every chat completion is routed.

    python examples/openai_sdk.py [--quick]

``openai.OpenAI(base_url=<fast>, http_client=httpx.Client(transport=AgentKVTransport(session)))``:
each ``chat.completions.create`` is counted as sent, routed (to the slow server once the conversation
outgrows the fast window), clamped, salted for the tenant, and warmed ahead at 60% of the fast window
with the same body, so the escalation finds its prefix cached. The agent's tool calls are scripted
(the embedded models have random weights); every request still goes to a real engine.
"""

from __future__ import annotations

import httpx
import openai
from _support import escalation_summary, parse_args, print_ledger, print_stats, quiet_logs, servers

from agentkv import Session
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.integrations.openai import AgentKVTransport


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    with servers(args.quick) as env, Session(fast=env.fast, slow=env.slow, tenant="acme",
                                             cache_salt_secret="example-secret") as s:
        client = openai.OpenAI(base_url=env.fast.api_base, api_key="-",
                               http_client=httpx.Client(transport=AgentKVTransport(s)))
        agent = ScriptedAgent(result_rows=1 if args.quick else 2)
        messages = agent.opening()
        for _ in range(40):
            answer = client.chat.completions.create(model=env.fast_server.model_id, messages=messages,
                                                    tools=TOOLS[:8], max_tokens=8)
            role = s.last_route.role if s.last_route else "fast"
            print(f"sent {len(messages)} messages; answered by {role} ({answer.usage.prompt_tokens} prompt tokens)")
            if role == "slow":
                break
            s.drain_warms(60)  # only so the demo's numbers do not depend on timing
            messages += agent.next_turn()
        print_ledger(s)
        print_stats(s)
        print(f"openai_sdk: {escalation_summary(s, env)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
