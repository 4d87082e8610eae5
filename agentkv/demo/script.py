"""A scripted ReAct agent: realistic tool schemas and tool results that grow the context turn by turn.

The embedded models have random weights, so their text is meaningless; the demo, the benchmarks and
the tests drive the conversation with this script instead, while every request still goes through
the Session, litellm and HTTP to a real engine.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = (
    "You are Atlas, an on-call SRE agent for a fleet of storage clusters. Investigate incidents with the "
    "tools you are given, cite the ids of the records you rely on, and stop when you can answer. Prefer "
    "read-only tools; never restart a service without an explicit instruction from the user."
)

USER_TASK = "Disk latency alerts fired on the eu-west storage cluster overnight. What happened, and is it over?"


def _fn(name: str, description: str, params: str, required: int = 1) -> dict[str, Any]:
    """A compact schema: ``params`` is "name:type name:type ..."; the first ``required`` are required."""
    fields = [p.split(":") for p in params.split()]
    properties = {n: {"type": t} for n, t in fields}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": [n for n, _ in fields[:required]]}}}


TOOLS: list[dict[str, Any]] = [
    _fn("search_incidents", "Search incidents by text.", "query:string limit:integer"),
    _fn("get_incident", "Fetch an incident and its timeline.", "incident_id:string"),
    _fn("query_metrics", "Run a PromQL query over a window.", "promql:string window:string", 2),
    _fn("list_alerts", "List alerts fired on a cluster.", "cluster:string window:string"),
    _fn("get_host", "Describe a host and its disks.", "hostname:string"),
    _fn("list_hosts", "List hosts of a cluster.", "cluster:string role:string"),
    _fn("tail_logs", "Tail a service's logs on a host.", "hostname:string service:string lines:integer", 2),
    _fn("search_logs", "Search a cluster's logs.", "cluster:string pattern:string", 2),
    _fn("get_deploys", "List recent deployments.", "cluster:string window:string"),
    _fn("get_runbook", "Fetch the runbook for an alert.", "alert:string"),
    _fn("disk_smart", "Read SMART data of a host's disks.", "hostname:string"),
    _fn("iostat", "Sample iostat on a host.", "hostname:string seconds:integer"),
    _fn("compaction_status", "Show compaction backlog.", "cluster:string"),
    _fn("get_config", "Read a config key.", "cluster:string key:string", 2),
    _fn("diff_config", "Diff config since a time.", "cluster:string since:string", 2),
    _fn("page_oncall", "Page a team's on-call.", "team:string message:string", 2),
    _fn("post_update", "Post an incident update.", "incident_id:string text:string", 2),
    _fn("create_ticket", "Open a follow-up ticket.", "team:string title:string", 2),
    _fn("restart_service", "Restart a service (needs approval).", "hostname:string service:string", 2),
    _fn("capacity_report", "Summarise pool capacity.", "cluster:string"),
]

_PLAN = [
    ("list_alerts", {"cluster": "eu-west-2", "window": "PT12H", "limit": 20}),
    ("search_incidents", {"query": "disk latency eu-west-2", "status": "any", "limit": 10}),
    ("query_metrics", {"promql": "histogram_quantile(0.99, rate(disk_io_seconds_bucket[5m]))", "window": "PT12H"}),
    ("list_hosts", {"cluster": "eu-west-2", "role": "storage"}),
    ("compaction_status", {"cluster": "eu-west-2"}),
    ("get_deploys", {"cluster": "eu-west-2", "window": "PT24H"}),
    ("search_logs", {"cluster": "eu-west-2", "pattern": "slow request|blocked for", "window": "PT12H", "limit": 50}),
    ("disk_smart", {"hostname": "st-eu2-07.storage.internal"}),
    ("tail_logs", {"hostname": "st-eu2-07.storage.internal", "service": "osd", "lines": 200}),
    ("diff_config", {"cluster": "eu-west-2", "since": "2026-11-29T00:00:00Z"}),
    ("capacity_report", {"cluster": "eu-west-2"}),
    ("get_runbook", {"alert": "DiskLatencyHigh"}),
]


@dataclass
class ScriptedAgent:
    """Produces the agent's next tool call and a deterministic tool result of about ``result_rows`` rows."""

    seed: int = 7
    result_rows: int = 6
    step: int = 0

    def opening(self) -> list[dict[str, Any]]:
        """The system prompt and the user's task."""
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_TASK}]

    def conversation(self, turns: int, *, tag: str = "") -> list[list[dict[str, Any]]]:
        """The requests of a conversation growing one step a request: the opening, then ``turns`` more, each a copy.
        ``tag`` is appended to the system prompt (distinct conversations then have distinct prefixes)."""
        msgs = self.opening()
        if tag:
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + tag}
        history = [copy.deepcopy(msgs)]
        for _ in range(turns):
            msgs = msgs + self.next_turn()
            history.append(copy.deepcopy(msgs))
        return history

    def next_turn(self, rows: int | None = None) -> list[dict[str, Any]]:
        """The assistant's tool call and the tool's result, to append after a model call."""
        name, args = _PLAN[self.step % len(_PLAN)]
        call_id = f"call_{self.step:03d}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        result = self._result(name, rows or self.result_rows)
        self.step += 1
        return [{"role": "assistant", "content": f"Step {self.step}: calling {name}.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": result}]

    def _result(self, name: str, rows: int) -> str:
        rng = random.Random(self.seed * 1000 + self.step)
        records = [{
            "id": f"{name[:3].upper()}-{self.step:02d}{i:02d}",
            "host": f"st-eu2-{rng.randint(1, 24):02d}.storage.internal",
            "at": f"2026-11-29T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z",
            "value_ms": round(rng.uniform(2, 900), 1),
            "note": rng.choice(["compaction backlog rising", "fsync stalls on sdb", "read retries on sdc",
                                "queue depth above 64", "recovered after throttle", "no anomaly"]),
        } for i in range(rows)]
        return json.dumps({"tool": name, "rows": records}, indent=1)
