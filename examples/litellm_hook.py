"""Plain litellm calls accounted by agentkv: AgentKVLogger feeds a Session's ledger and cache statistics.

    python examples/litellm_hook.py [--quick]

The agent below never calls the Session: it uses ``litellm.completion`` directly against the fast
server. The logger observes each call before it is sent (exact count, ledger row, warm-ahead at 60%
of the fast window) and records the prefix-cache hits of each answer. A logger cannot reroute, so
when the fast server finally rejects the conversation as too long, the agent resends it to the slow
server itself, where the warm-ahead has already prefilled most of it.
"""

from __future__ import annotations

from _support import parse_args, print_ledger, print_stats, quiet_logs, servers

from agentkv import Session
from agentkv.integrations.litellm import AgentKVLogger  # sets litellm's cost map local before importing it
from agentkv.overflow import overflow_from_error
from agentkv.demo.script import TOOLS, ScriptedAgent


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    import litellm

    litellm.suppress_debug_info = True  # no "Give Feedback" banner when fast rejects the long conversation
    with servers(args.quick) as env:
        fast = {"model": env.fast.model, "api_base": env.fast.api_base}
        slow = {"model": env.slow.model, "api_base": env.slow.api_base}
        agent = ScriptedAgent(result_rows=1 if args.quick else 2)
        messages = agent.opening()
        saved = list(litellm.callbacks)
        with Session(fast=env.fast, slow=env.slow) as s:
            logger = AgentKVLogger(s)
            litellm.callbacks = [logger]
            try:
                escalated = _loop(litellm, fast, slow, agent, messages)
                logger.wait(finished=logger.counters["observed"], timeout_s=30)  # success hooks run on a thread
            finally:
                litellm.callbacks = saved
            s.drain_warms(60)
        print_ledger(s)
        print_stats(s)
        print(f"logger counters: {logger.counters}")
        usage = escalated.usage
        print(f"litellm_hook: {logger.counters['observed']} calls observed; the escalated call to slow had "
              f"{usage.prompt_tokens_details.cached_tokens} of {usage.prompt_tokens} prompt tokens cached by the warm")
    return 0


def _loop(litellm, fast, slow, agent, messages):
    """Send the growing conversation to fast until it overflows; then send it to slow. Returns the slow answer."""
    for _ in range(30):
        try:
            litellm.completion(**fast, messages=messages, tools=TOOLS[:8], max_tokens=4)
        except Exception as exc:
            if overflow_from_error(exc) is None:
                raise
            print("fast rejected the conversation as too long; resending it to slow")
            return litellm.completion(**slow, messages=messages, tools=TOOLS[:8], max_tokens=4)
        print(f"sent {len(messages)} messages to fast")
        messages += agent.next_turn()
    raise RuntimeError("the conversation never outgrew the fast model")


if __name__ == "__main__":
    raise SystemExit(main())
