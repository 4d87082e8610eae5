"""Quickstart: one Session, two backends, a conversation that outgrows the fast model.

    python examples/quickstart.py [--quick]

A scripted agent (agentkv.demo.script) appends a tool call and its result each turn; every turn goes
through ``Session.completion``: counted exactly, routed to fast while it fits, warmed at 60% of the
fast window, and sent straight to slow once it no longer fits.
"""

from __future__ import annotations

from _support import parse_args, print_ledger, print_stats, quiet_logs, servers

from agentkv import Session
from agentkv.demo.script import TOOLS, ScriptedAgent


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    turns_after_escalation = 1 if args.quick else 3
    with servers(args.quick) as env:
        agent = ScriptedAgent(result_rows=1 if args.quick else 2)
        messages = agent.opening()
        with Session(fast=env.fast, slow=env.slow, tenant="acme", cache_salt_secret="example-secret") as s:
            while turns_after_escalation > 0 and len(s.ledger) < 20:
                s.completion(messages=messages, tools=TOOLS[:8], max_tokens=4)
                s.drain_warms(60)  # the demo waits so the table shows the warm landing; real calls never wait
                route = s.last_route
                print(f"turn {len(s.ledger)}: {route.estimated_input_tokens} tokens -> {route.backend} ({route.reason})")
                if route.role == "slow":
                    turns_after_escalation -= 1
                messages = messages + agent.next_turn()
        print_ledger(s)
        print_stats(s)
        first_slow = next(row for row in s.ledger if row.backend == "slow")
        print(f"quickstart: escalated to slow at turn {first_slow.turn} with {first_slow.input_tokens} tokens, "
              f"{first_slow.cached_tokens} of them already cached by the warm-ahead")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
