"""Per-turn token-accounting cost on a 100K-token, 40-tool-call ReAct trace.

Side by side in one run: agentkv's incremental counters (exact template source, approximate tiktoken
source) against a full recount each turn with ``litellm.token_counter``; then the last turn's cost
(the trace's last tool result appended) at 10K, 50K and 100K tokens, medians side by side, where the
incremental counter should cost the same at every length. Also prints how far
``litellm.token_counter`` is from the template-rendered count of the 20 tool schemas.

    python benchmarks/accounting.py
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from agentkv._support.env import import_litellm  # noqa: E402
from agentkv.tokens import Payload, TemplateSource, TiktokenSource  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Operation {i}: query the fleet inventory and return JSON rows.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "maximum rows", "minimum": 1, "maximum": 500},
            "region": {"type": "string", "enum": ["eu", "us", "ap"]}}, "required": ["query"]}}}
    for i in range(20)
]


def trace(tool_calls: int = 40, rows: int = 46) -> list[dict]:
    """A ReAct trace whose tool results bring it to about 100K tokens after ``tool_calls`` calls."""
    msgs: list[dict] = [{"role": "system", "content": "You are an SRE agent. Use tools; cite row ids."},
                        {"role": "user", "content": "Which hosts had disk incidents this quarter, and why?"}]
    for i in range(tool_calls):
        args = json.dumps({"query": f"disk incidents batch {i}", "limit": rows})
        msgs.append({"role": "assistant", "content": f"Checking batch {i}.",
                     "tool_calls": [{"id": f"call_{i}", "type": "function",
                                     "function": {"name": f"tool_{i % 20}", "arguments": args}}]})
        result = [{"id": f"inc-{i}-{j}", "host": f"node-{(i * 7 + j) % 97}", "severity": j % 4,
                   "summary": f"Disk latency p99 rose to {100 + j * 3} ms after compaction on volume v{j}."}
                  for j in range(rows)]
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(result, indent=1)})
    return msgs


def per_turn_seconds(count, msgs: list[dict]) -> list[float]:
    times = []
    for n in range(3, len(msgs) + 1):
        start = time.perf_counter()
        count(msgs[:n])
        times.append(time.perf_counter() - start)
    return times


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def last_turn_seconds(make_source, msgs: list[dict], runs: int = 7) -> float:
    """The cost of counting ``msgs`` right after the agent's earlier turns ``msgs[:n]`` were counted: the
    median over ``runs`` fresh sources (each has seen every earlier turn, none the last message)."""
    times = []
    for _ in range(runs):
        source = make_source()
        for n in range(1, len(msgs)):
            source.count(Payload(tuple(msgs[:n]), tuple(TOOLS)))
        times.append(_timed(functools.partial(source.count, Payload(tuple(msgs), tuple(TOOLS)))))
    return statistics.median(times)


def main() -> None:
    litellm = import_litellm()
    msgs = trace()
    template, approx = TemplateSource("cl100k_base"), TiktokenSource()  # fresh: they see the trace turn by turn
    sizer = TemplateSource("cl100k_base")  # the figures printed (its memo would flatter the timed counters)
    total = sizer.count(Payload(tuple(msgs), tuple(TOOLS))).total
    runs = {
        "agentkv template (exact)": lambda m: template.count(Payload(tuple(m), tuple(TOOLS))),
        "agentkv tiktoken (approx)": lambda m: approx.count(Payload(tuple(m), tuple(TOOLS))),
        "litellm.token_counter (full)": lambda m: litellm.token_counter(model="gpt-4", messages=m, tools=TOOLS),
    }
    print(f"trace: {len(msgs)} messages, 40 tool calls, {total} tokens (template count)")
    results = {name: per_turn_seconds(fn, msgs) for name, fn in runs.items()}
    print("per turn over the whole trace (amortised: the first full count, and the incremental counts' checks "
          "against a full rendering, included):")
    for name, times in results.items():
        print(f"{name:30s} mean {statistics.mean(times) * 1000:8.2f} ms/turn   last turn {times[-1] * 1000:8.2f} ms")
    base = statistics.mean(results["litellm.token_counter (full)"])
    for name in list(runs)[:2]:
        print(f"speed-up of {name} over full litellm recount: {base / statistics.mean(results[name]):.1f}x")
    print("last turn (one ~2.4K-token tool result appended), medians (7 fresh counters; 5 litellm recounts):")
    for calls in (4, 20, 40):
        convo = trace(calls)
        size = sizer.count(Payload(tuple(convo), tuple(TOOLS))).total
        mine = last_turn_seconds(lambda: TemplateSource("cl100k_base"), convo)
        full = functools.partial(litellm.token_counter, model="gpt-4", messages=convo, tools=TOOLS)
        theirs = statistics.median(_timed(full) for _ in range(5))
        print(f"  {size:7d} tokens: incremental exact {mine * 1000:7.3f} ms   litellm.token_counter {theirs * 1000:8.2f} ms"
              f"   ratio {theirs / mine:6.0f}x")
    probe = [{"role": "user", "content": "hi"}]
    rendered = sizer.count(Payload(tuple(probe), tuple(TOOLS))).tools
    with_tools = litellm.token_counter(model="gpt-4", messages=probe, tools=TOOLS)
    counted = with_tools - litellm.token_counter(model="gpt-4", messages=probe)
    print(f"20 tool schemas: template-rendered {rendered} tokens, litellm.token_counter {counted} "
          f"({(counted - rendered) / rendered:+.0%})")


if __name__ == "__main__":
    main()
