"""Multi-turn tool conversations from AgentDojo's four suites, built offline from the package and cached.

Runs under a Python that has ``agentdojo==0.1.35`` (a venv of its own: see ``load.py``), never imports agentkv, and
imports agentdojo only inside :func:`build`, so ``load.py`` can read :func:`cache_path` from our venv.

For each user task of each suite (benchmark version :data:`BENCHMARK_VERSION`, the package's own default), the
task's ground-truth tool calls run against the suite's environment through AgentDojo's ``FunctionsRuntime``, and the
conversation is recorded as OpenAI chat messages: AgentDojo's default system message, the task's prompt, one
assistant message per call (``tool_calls``: id, name, JSON arguments as AgentDojo's OpenAI pipeline dumps them)
followed by its ``tool`` message (the result through AgentDojo's ``tool_result_to_str``, YAML, or the runtime's
error text, as its OpenAI pipeline sends them), and a final assistant answer (the task's ``GROUND_TRUTH_OUTPUT``
when it has one, else a one-line summary naming the tools used). Tools are the suite's functions as AgentDojo's
OpenAI pipeline builds them (``_function_to_openai``: name, description, the pydantic model's JSON schema).

Sessions chain several user tasks of one suite into one message list, as one assistant meets them over a working
day: the environment carries over from task to task (each task's ``init_environment`` is applied to it, and its
ground truth is computed from the carried state; a call the carried state refuses is recorded with its error, as
the agent would have seen it). Choice and order are seeded: same parameters, same bytes. Two things in the package
vary from run to run, and are pinned: the tools that stamp ``datetime.now()`` (sent emails, created files) read a
clock that starts at :data:`CLOCK_START` in each conversation and ticks a minute a read, and the calendar's
``list(set(participants))`` follows string hashing, so the script runs itself under ``PYTHONHASHSEED=0``.

    /path/to/agentdojo-venv/bin/python benchmarks/workloads/agentdojo_build.py            # writes the cache
    ... agentdojo_build.py --out /tmp/w.jsonl --suites banking --sessions-per-suite 2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "AGENTDOJO_VERSION", "BENCHMARK_VERSION", "SCHEMA", "SUITES",
    "BuildParams", "build", "cache_key", "cache_path", "main",
]

AGENTDOJO_VERSION = "0.1.35"
BENCHMARK_VERSION = "v1.2.2"  # agentdojo 0.1.35's default (``agentdojo.scripts.benchmark --benchmark-version``)
SCHEMA = "agentkv.workload.agentdojo/1"
SUITES = ("workspace", "travel", "banking", "slack")
CLOCK_START = datetime.datetime(2024, 5, 15, 9, 0)  # the workspace calendar's ``current_day``, at nine
_STAMPING_MODULES = ("email_client", "cloud_drive_client")  # agentdojo.default_suites.v1.tools.*: datetime.now()


@dataclass(frozen=True)
class BuildParams:
    """What a build depends on besides the package: ``BuildParams(seed=0, sessions_per_suite=16)``."""

    seed: int = 0
    sessions_per_suite: int = 16
    min_tasks: int = 2
    max_tasks: int = 8
    suites: tuple[str, ...] = SUITES


def cache_key(params: BuildParams) -> str:
    """12 hex digits over this builder's source, the package versions and ``params``."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps([AGENTDOJO_VERSION, BENCHMARK_VERSION, SCHEMA, dataclasses.asdict(params)]).encode())
    return h.hexdigest()[:12]


def cache_path(params: BuildParams, root: Path | None = None) -> Path:
    """``~/.cache/agentkv/workloads/agentdojo-<version>-<key>.jsonl`` (``root`` replaces the folder)."""
    folder = root or Path.home() / ".cache" / "agentkv" / "workloads"
    return folder / f"agentdojo-{AGENTDOJO_VERSION}-{cache_key(params)}.jsonl"


def build(params: BuildParams) -> list[dict[str, Any]]:
    """Every suite's single-task conversations, then its chained sessions."""
    from agentdojo.agent_pipeline.agent_pipeline import load_system_message
    from agentdojo.task_suite.load_suites import get_suite

    system = load_system_message(None)
    clock = _pin_clock()
    conversations: list[dict[str, Any]] = []
    for name in params.suites:
        suite = get_suite(BENCHMARK_VERSION, name)
        ids = sorted(suite.user_tasks, key=_task_number)
        env = suite.load_and_inject_default_environment({})  # the injection vectors' benign defaults
        conversations += [_conversation(suite, env, system, clock, f"{name}/{tid}", [tid]) for tid in ids]
        rng = random.Random(f"{params.seed}:{name}")
        for n in range(params.sessions_per_suite):
            chosen = rng.sample(ids, rng.randint(params.min_tasks, min(params.max_tasks, len(ids))))
            conversations.append(_conversation(suite, env, system, clock, f"{name}/session-{n:03d}", chosen))
    return conversations


class _Clock:
    """``datetime.datetime`` as the stamping tools see it: ``now()`` reads a pinned clock, the rest is the real class."""

    def __init__(self) -> None:
        self.reads = 0

    def now(self, tz: datetime.tzinfo | None = None) -> datetime.datetime:
        self.reads += 1
        return (CLOCK_START + datetime.timedelta(minutes=self.reads - 1)).replace(tzinfo=tz)

    def __getattr__(self, name: str) -> Any:
        return getattr(datetime.datetime, name)


class _DatetimeModule:
    """The ``datetime`` module with its ``datetime`` class replaced by a :class:`_Clock`."""

    def __init__(self, clock: _Clock) -> None:
        self.datetime = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(datetime, name)


def _pin_clock() -> _Clock:
    import importlib

    clock = _Clock()
    for name in _STAMPING_MODULES:
        namespace = vars(importlib.import_module(f"agentdojo.default_suites.v1.tools.{name}"))
        if namespace.get("datetime") is not datetime and not isinstance(namespace.get("datetime"), _DatetimeModule):
            raise RuntimeError(f"agentdojo's {name} no longer stamps through the datetime module: revisit the pin")
        namespace["datetime"] = _DatetimeModule(clock)
    return clock


def _task_number(task_id: str) -> int:
    match = re.search(r"(\d+)$", task_id)
    return int(match.group(1)) if match else -1


def _conversation(
    suite: Any, initial: Any, system: str, clock: _Clock, conv_id: str, task_ids: Sequence[str]
) -> dict[str, Any]:
    """One conversation: ``task_ids`` run in order on a copy of ``initial``, one runtime, one message list."""
    from agentdojo.agent_pipeline.llms.openai_llm import _function_to_openai
    from agentdojo.functions_runtime import FunctionsRuntime

    env = initial.model_copy(deep=True)
    clock.reads = 0
    runtime = FunctionsRuntime(suite.tools)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    requests: list[list[int]] = []
    errors = 0
    for n, tid in enumerate(task_ids):
        task = suite.user_tasks[tid]
        env = task.init_environment(env)
        calls = task.ground_truth(env.model_copy(deep=True))
        messages.append({"role": "user", "content": task.PROMPT})
        turn: list[int] = []
        for j, call in enumerate(calls):
            call_id = "call_" + hashlib.sha256(f"{conv_id}/{n}/{j}".encode()).hexdigest()[:24]
            turn.append(len(messages))
            messages.append(_assistant_call(call_id, call.function, call.args))
            content, failed = _run(runtime, env, call.function, call.args)
            errors += failed
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        turn.append(len(messages))
        messages.append({"role": "assistant", "content": _final_answer(task, [c.function for c in calls])})
        requests.append(turn)
    return {
        "schema": SCHEMA, "id": conv_id, "suite": suite.name, "kind": "session" if len(task_ids) > 1 else "task",
        "source": f"agentdojo=={AGENTDOJO_VERSION} {BENCHMARK_VERSION}", "tasks": list(task_ids),
        "tools": [dict(_function_to_openai(f)) for f in runtime.functions.values()],
        "messages": messages, "requests": requests, "tool_errors": errors,
    }


def _assistant_call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The assistant's request for one call, with AgentDojo's ``json.dumps(tool_call.args)`` as its arguments."""
    function = {"name": name, "arguments": json.dumps(args)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": function}]}


def _run(runtime: Any, env: Any, name: str, args: dict[str, Any]) -> tuple[str, bool]:
    """The tool message's text as AgentDojo's pipeline sends it (its error text when the call fails), and whether it failed."""
    from agentdojo.agent_pipeline.tool_execution import tool_result_to_str

    result, error = runtime.run_function(env, name, args)
    return (error, True) if error else (tool_result_to_str(result), False)


def _final_answer(task: Any, functions: Sequence[str]) -> str:
    expected = str(task.GROUND_TRUTH_OUTPUT or "").strip()
    if expected:
        return expected
    used = ", ".join(dict.fromkeys(functions))
    return f"Done: I used {used}." if used else "Done."


def _write(conversations: list[dict[str, Any]], out: Path) -> None:
    """All lines to a temporary file beside ``out``, renamed into place: a reader never sees half a build."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for conversation in conversations:
            f.write(json.dumps(conversation, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(tmp, out)


def _print_stats(conversations: list[dict[str, Any]], out: Path) -> None:
    print(f"wrote {len(conversations)} conversations to {out}")
    print(f"{'suite':<10} {'kind':<8} {'convs':>5} {'tasks':>5} {'requests':>8} {'tool errors':>11}")
    for suite in dict.fromkeys(c["suite"] for c in conversations):
        for kind in ("task", "session"):
            group = [c for c in conversations if c["suite"] == suite and c["kind"] == kind]
            tasks = sum(len(c["tasks"]) for c in group)
            requests = sum(len(r) for c in group for r in c["requests"])
            errors = sum(c["tool_errors"] for c in group)
            print(f"{suite:<10} {kind:<8} {len(group):>5} {tasks:>5} {requests:>8} {errors:>11}")


def main(argv: Sequence[str] | None = None) -> int:
    defaults = BuildParams()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where to write (default: the cache path of these parameters)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sessions-per-suite", type=int, default=defaults.sessions_per_suite)
    parser.add_argument("--min-tasks", type=int, default=defaults.min_tasks)
    parser.add_argument("--max-tasks", type=int, default=defaults.max_tasks)
    parser.add_argument("--suites", default=",".join(defaults.suites), help="comma-separated, of " + ", ".join(SUITES))
    parser.add_argument("--print-path", action="store_true", help="print the cache path of these parameters and exit")
    args = parser.parse_args(argv)
    params = BuildParams(args.seed, args.sessions_per_suite, args.min_tasks, args.max_tasks, tuple(args.suites.split(",")))
    if not 1 <= params.min_tasks <= params.max_tasks or not set(params.suites) <= set(SUITES):
        parser.error("need 1 <= --min-tasks <= --max-tasks and suites among " + ", ".join(SUITES))
    out = args.out or cache_path(params)
    if args.print_path:
        print(out)
        return 0
    conversations = build(params)
    _write(conversations, out)
    _print_stats(conversations, out)
    return 0


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order inside the tools follows string hashing
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, "PYTHONHASHSEED": "0"})
    sys.exit(main())
