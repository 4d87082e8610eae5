"""@agentkv.session on a hand-written tool loop: no Session threaded through the code.

    python examples/decorator_loop.py [--quick]

``configure()`` sets the backends once; each call of the decorated ``investigate`` runs in its own
Session (fresh session id, the caller's tenant), which the module-level ``completion()`` routes
through. A decorated helper called inside reuses that Session. Two concurrent async agents under
``asyncio.gather`` each see their own Session.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from _support import ScriptedModel, parse_args, print_ledger, print_stats, quiet_logs, servers, storage_logs, tool_call

from agentkv.decorator import acompletion, completion, configure, current_session, session
from agentkv.toolschema import function_schema

LINES = 16


def fetch_logs(host: str, service: str = "osd") -> str:
    """Fetch recent logs of a service on a storage host.

    Args:
        host: The host name, e.g. st-eu2-07.
        service: The service whose logs to read (choices: ["osd", "mon"])
    """
    return storage_logs(host, LINES)


TOOLS = {"fetch_logs": fetch_logs}
SCHEMAS = [function_schema(fetch_logs)]


@session
def investigate(task: str, max_steps: int = 8) -> tuple[str, Any]:
    """A ReAct loop written by hand: call the model, run the tools it asks for, stop at an answer.

    Returns the answer and the call's Session (closed by the time the caller sees it) for printing.
    """
    messages = [{"role": "system", "content": "You are an on-call SRE agent."}, {"role": "user", "content": task}]
    for _ in range(max_steps):
        reply = completion(messages=messages, tools=SCHEMAS, max_tokens=4).choices[0].message
        calls = reply.tool_calls or []
        messages.append({"role": "assistant", "content": reply.content or "", "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]} if calls else {"role": "assistant", "content": reply.content or ""})
        if not calls:
            return summarise(reply.content), current_session()
        for call in calls:
            result = TOOLS[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "gave up", current_session()


@session
def summarise(answer: str) -> str:
    """Nested inside investigate(): it reuses the caller's Session instead of opening another."""
    s = current_session()
    return f"{answer} ({len(s.ledger)} model calls in session {s.session_id[:8]}, tenant {s.tenant})"


@session
async def triage(alert: str) -> tuple[str, str | None, str | None]:
    """One async model call; each concurrent triage() sees its own Session."""
    await acompletion(messages=[{"role": "user", "content": alert}], max_tokens=2)
    s = current_session()
    return s.session_id, s.tenant, s.request_extras("fast").get("extra_body", {}).get("cache_salt")


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    hosts = 3 if args.quick else 5
    script = [tool_call("fetch_logs", host=f"st-eu2-{i:02d}") for i in range(hosts)] + ["Compaction backlog on sdb."]
    with servers(args.quick) as env:
        configure(fast=env.fast, slow=env.slow, client=ScriptedModel(script), cache_salt_secret="example-secret")
        answer, s = investigate("Disk latency alerts on eu-west overnight: what happened?", tenant="acme")
        print(f"answer: {answer}")
        s.drain_warms(60)
        print_ledger(s)
        print_stats(s)
        results = asyncio.run(_two_tenants())
        for session_id, tenant, salt in results:
            print(f"concurrent triage: session {session_id[:8]} tenant {tenant} cache_salt {salt[:12]}...")
        configure()
    routes = " ".join(row.backend for row in s.ledger)
    print(f"decorator_loop: {len(s.ledger)} model calls, routes {routes}, session closed={s.closed}")
    return 0


async def _two_tenants() -> list[tuple[str, str | None, str | None]]:
    return list(await asyncio.gather(triage("disk alert", tenant="acme"), triage("disk alert", tenant="globex")))


if __name__ == "__main__":
    raise SystemExit(main())
