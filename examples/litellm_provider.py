"""Any framework that takes a litellm model string, routed by agentkv: register("agentkv", convs), then "agentkv/fast".

    python examples/litellm_provider.py [--quick]

``agentkv.integrations.litellm.register("agentkv", convs)`` registers a litellm provider: every
``litellm.completion(model="agentkv/<alias>", ...)`` (async and streamed too) then runs through its conversation's
Session, which counts, routes, clamps, salts and warms it. Here smolagents' ``ToolCallingAgent`` on
``LiteLLMModel(model_id="agentkv/fast")`` investigates an incident; its conversation (named by the calls'
``metadata={"session_id": ...}``; without one, by its opening) outgrows the fast window, a warm fires on the way, and
the escalated call runs on slow, which reports the warm's blocks as cached. The answer the agent gets is the
backend's own ``ModelResponse``. The tool calls are scripted (:class:`agentkv.testing.ScriptedReplies` as the
Sessions' client: random-weight models); each request is real.
"""

from __future__ import annotations

import json
from typing import Any

from _support import parse_args, print_ledger, quiet_logs, servers, storage_logs

from agentkv import Conversations
from agentkv.integrations.litellm import register, unregister
from agentkv.testing import ScriptedReplies


def script(steps: int) -> list[Any]:
    """``steps`` turns calling ``lookup``, then smolagents' ``final_answer`` tool."""
    calls: list[Any] = [[("lookup", json.dumps({"host": f"osd-{i:02d}"}))] for i in range(steps)]
    return calls + [[("final_answer", json.dumps({"answer": "Compaction on osd-03."}))]]


def warm_read(session: Any, block: int) -> str:
    """How much of its warm the escalated call read: slow's cached_tokens against the warm's full blocks."""
    fired = next(row for row in session.ledger if row.warm == "fire")
    row = next(row for row in session.ledger if row.backend == "slow")
    full = fired.input_tokens // block * block
    return (f"the escalation at call {row.turn} ({row.input_tokens} tokens) read {row.cached_tokens} cached tokens, "
            f"{row.cached_tokens / full:.0%} of the warm's {full} full-block tokens (warm fired at call {fired.turn})")


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    from smolagents import LiteLLMModel, ToolCallingAgent, tool

    @tool
    def lookup(host: str) -> str:
        """Read the slow-request log of a storage host.

        Args:
            host: The host name.
        """
        return storage_logs(host, 5)

    steps = 8 if args.quick else 14
    with servers(args.quick) as env, Conversations(env.fast, env.slow, tenant="acme", cache_salt_secret="example-secret",
                                                   client=ScriptedReplies(script(steps))) as convs:
        register("agentkv", convs)  # litellm.completion(model="agentkv/...") now runs through convs
        try:
            model = LiteLLMModel(model_id="agentkv/fast", max_tokens=8, metadata={"session_id": "incident-7"})
            agent = ToolCallingAgent(tools=[lookup], model=model, max_steps=steps + 2, verbosity_level=0,
                                     instructions="Investigate the fleet.")
            answer = agent.run("Why did disk latency rise overnight?")
            convs.drain_warms(60)  # only so the demo's numbers do not depend on timing
        finally:
            unregister("agentkv")
        print(f"final answer: {answer}")
        session = convs.session_for("incident-7")  # the conversation the calls' metadata names
        print_ledger(session)
        stats = convs.stats()
        print(f"convs.stats(): {stats['conversations']} conversation; totals "
              f"{ {k: v for k, v in stats['totals'].items() if v and k != 'requests_total'} }")
        print(f"litellm_provider: smolagents made {len(session.ledger)} calls through agentkv/fast, routes "
              f"{stats['totals']['requests']}; {warm_read(session, env.slow_server.engine.prefix_cache.block_size)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
