"""Load the AgentDojo workload: build it once in a venv of its own, then read and validate the cached JSON lines.

    from benchmarks.workloads.load import load_agentdojo      # (``from workloads.load ...`` from a benchmarks/ script)
    for conversation in load_agentdojo():
        for request in conversation.replay():                 # every model request the agent made, in order
            send(request.messages, tools=conversation.tools)  # request.answer: what the agent answered

Runs under agentkv's venv and never imports agentdojo: ``agentdojo==0.1.35`` lives in ``$AGENTKV_AGENTDOJO_VENV``
when set (used as it is, never installed into), else in ``~/.cache/agentkv/agentdojo-venv``, installed on first use
like ``agentkv.vllm_launch.install`` (pip needs the network that once). The builder, ``agentdojo_build.py``, runs in
it and writes ``~/.cache/agentkv/workloads/agentdojo-0.1.35-<key>.jsonl``; the key covers the builder's source and
its parameters, so an edited builder builds anew. ``python -m benchmarks.workloads.load`` prints the statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from agentkv._support.build import built_once

from . import agentdojo_build
from .agentdojo_build import AGENTDOJO_VERSION, SCHEMA, BuildParams

__all__ = [
    "SCHEMA", "BuildParams", "Conversation", "Request", "WorkloadError",
    "default_venv", "ensure_venv", "load_agentdojo", "read_workload", "token_profile", "validate",
]

_MARKER = ".agentkv-installed"
_ROLES = ("system", "user", "assistant", "tool")


class WorkloadError(ValueError):
    """A workload line that breaks the format (what, and which conversation)."""


@dataclass(frozen=True)
class Request:
    """One model request: the ``messages`` sent (the conversation up to it) and the ``answer`` the agent gave."""

    conversation: str
    task: int  # index into Conversation.tasks
    messages: tuple[Mapping[str, Any], ...]
    answer: Mapping[str, Any]


@dataclass(frozen=True)
class Conversation:
    """One conversation of the workload (a single task, or a session of chained tasks)."""

    id: str
    suite: str
    kind: str  # "task" or "session"
    tasks: tuple[str, ...]
    tools: tuple[Mapping[str, Any], ...]
    messages: tuple[Mapping[str, Any], ...]
    requests: tuple[tuple[int, ...], ...]  # per task: n where a request sends messages[:n] and messages[n] answers
    tool_errors: int

    def replay(self) -> Iterator[Request]:
        """Every model request, in the order the agent made them."""
        for task, indices in enumerate(self.requests):
            for n in indices:
                yield Request(self.id, task, self.messages[:n], self.messages[n])


def default_venv() -> Path:
    """``$AGENTKV_AGENTDOJO_VENV``, else ``~/.cache/agentkv/agentdojo-venv``."""
    configured = os.environ.get("AGENTKV_AGENTDOJO_VENV")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "agentkv" / "agentdojo-venv"


def venv_python(venv: Path | None = None) -> Path | None:
    """The interpreter of a venv ready to build: a configured one as it is, ours once its install finished."""
    root = venv or default_venv()
    python = root / "bin" / "python"
    configured = venv is None and bool(os.environ.get("AGENTKV_AGENTDOJO_VENV"))
    return python if python.exists() and (configured or (root / _MARKER).exists()) else None


def ensure_venv(venv: Path | None = None, *, quiet: bool = True) -> Path:
    """The interpreter of a venv holding ``agentdojo==AGENTDOJO_VERSION``, installing it first when absent."""
    ready = venv_python(venv)
    if ready is not None:
        return ready
    root = venv or default_venv()
    if venv is None and os.environ.get("AGENTKV_AGENTDOJO_VENV"):
        raise FileNotFoundError(f"$AGENTKV_AGENTDOJO_VENV names {root}, which has no bin/python")
    with built_once(root, root / _MARKER) as needed:
        if needed:
            _install(root, quiet=quiet)
    return root / "bin" / "python"


def _install(root: Path, *, quiet: bool) -> None:
    flags = ["--quiet"] if quiet else []
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", *flags, "--disable-pip-version-check"]
    subprocess.run([*pip, f"agentdojo=={AGENTDOJO_VERSION}"], check=True)
    (root / _MARKER).write_text(AGENTDOJO_VERSION + "\n")


def load_agentdojo(params: BuildParams = BuildParams(), *, cache: Path | None = None,
                   venv: Path | None = None) -> list[Conversation]:
    """The workload of ``params``, built first when its cache file is absent (``cache`` replaces the folder)."""
    path = agentdojo_build.cache_path(params, cache)
    if not path.exists():
        build(params, path, venv=venv)
    return read_workload(path)


def build(params: BuildParams, out: Path, *, venv: Path | None = None) -> None:
    """Run the builder in the agentdojo venv, writing ``out`` (it prints its own statistics)."""
    args = ["--out", str(out), "--seed", str(params.seed), "--sessions-per-suite", str(params.sessions_per_suite),
            "--min-tasks", str(params.min_tasks), "--max-tasks", str(params.max_tasks), "--suites", ",".join(params.suites)]
    subprocess.run([str(ensure_venv(venv)), agentdojo_build.__file__, *args], check=True)


def read_workload(path: Path) -> list[Conversation]:
    """Every line of ``path``, validated (:class:`WorkloadError` names the first fault)."""
    with open(path, encoding="utf-8") as f:
        return [validate(json.loads(line)) for line in f if line.strip()]


def validate(line: Mapping[str, Any]) -> Conversation:
    """One line as a :class:`Conversation`, after checking the format the README describes."""
    name = str(line.get("id", "?"))
    if line.get("schema") != SCHEMA:
        raise WorkloadError(f"{name}: schema {line.get('schema')!r}, expected {SCHEMA!r}")
    messages, requests, tasks = line.get("messages"), line.get("requests"), line.get("tasks")
    if not isinstance(messages, list) or not isinstance(requests, list) or not isinstance(tasks, list):
        raise WorkloadError(f"{name}: messages, requests and tasks must be lists")
    if len(requests) != len(tasks) or not tasks:
        raise WorkloadError(f"{name}: {len(tasks)} tasks but {len(requests)} request lists")
    _check_messages(name, messages)
    _check_requests(name, messages, requests)
    return Conversation(
        id=name, suite=str(line["suite"]), kind=str(line["kind"]), tasks=tuple(tasks), tools=tuple(line["tools"]),
        messages=tuple(messages), requests=tuple(tuple(r) for r in requests), tool_errors=int(line.get("tool_errors", 0)),
    )


def _check_messages(name: str, messages: Sequence[Mapping[str, Any]]) -> None:
    """Roles known; every assistant tool call answered by a tool message with its id, before the next request."""
    pending: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            raise WorkloadError(f"{name}: message {i} has role {role!r}")
        if role == "tool":
            if message.get("tool_call_id") not in pending:
                raise WorkloadError(f"{name}: tool message {i} answers no pending call")
            pending.remove(message["tool_call_id"])
            continue
        if pending:
            raise WorkloadError(f"{name}: message {i} comes before the results of calls {pending}")
        if role == "assistant":
            pending = [call["id"] for call in message.get("tool_calls") or ()]
    if pending:
        raise WorkloadError(f"{name}: calls {pending} never answered")


def _check_requests(name: str, messages: Sequence[Mapping[str, Any]], requests: Sequence[Sequence[int]]) -> None:
    """Increasing indices of assistant messages, each after a user or tool message: one per assistant message."""
    flat = [n for task in requests for n in task]
    if flat != sorted(set(flat)):
        raise WorkloadError(f"{name}: request indices must increase")
    for n in flat:
        if not (0 < n < len(messages)) or messages[n].get("role") != "assistant":
            raise WorkloadError(f"{name}: request at {n} is not answered by an assistant message")
        if messages[n - 1].get("role") not in ("user", "tool"):
            raise WorkloadError(f"{name}: request at {n} follows a {messages[n - 1].get('role')} message")
    if len(flat) != sum(m.get("role") == "assistant" for m in messages):
        raise WorkloadError(f"{name}: an assistant message is not any request's answer")


def token_profile(conversations: Sequence[Conversation], encoding: str = "cl100k_base") -> list[tuple[int, int]]:
    """Tokens at each conversation's first and last request, as the embedded engine renders them (exact: agentkv's
    ChatML template with the tools, ``encoding``), one pair per conversation."""
    from agentkv._support.env import ensure_tiktoken_offline
    from agentkv.tokens import TemplateSource
    from agentkv.tokens.payload import Payload

    ensure_tiktoken_offline()
    source = TemplateSource(encoding, incremental=False)
    profile: list[tuple[int, int]] = []
    for c in conversations:
        requests = list(c.replay())
        first, last = (source.count(Payload(messages=r.messages, tools=c.tools)).total for r in (requests[0], requests[-1]))
        profile.append((first, last))
    return profile


def _quantiles(values: Sequence[int]) -> str:
    ordered = sorted(values)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.1, 0.5, 0.9)]
    return " / ".join(f"{v:,}" for v in (*pick, ordered[-1]))


def _print_summary(conversations: Sequence[Conversation]) -> None:
    for kind in ("task", "session"):
        group = [c for c in conversations if c.kind == kind]
        per_suite = ", ".join(f"{s} {sum(c.suite == s for c in group)}" for s in dict.fromkeys(c.suite for c in group))
        requests = sum(len(r) for c in group for r in c.requests)
        print(f"{kind}: {len(group)} conversations ({per_suite}), {requests} requests, "
              f"{statistics.mean(len(c.tasks) for c in group):.1f} tasks each")
    profile = token_profile(conversations)
    print("tokens (cl100k_base, agentkv's ChatML template with tools), p10 / p50 / p90 / max:")
    for kind in ("task", "session"):
        for suite in ("all", *dict.fromkeys(c.suite for c in conversations)):
            rows = [p for c, p in zip(conversations, profile) if c.kind == kind and suite in ("all", c.suite)]
            firsts, lasts = _quantiles([f for f, _ in rows]), _quantiles([last for _, last in rows])
            print(f"  {kind:<8} {suite:<10} first request {firsts:<30} last request {lasts}")
    print("share opening below 60% of a fast window and ending past it (tasks, sessions):")
    for window in (4096, 6144, 8192, 12288, 16384):
        shares = [_escalating(conversations, profile, kind, window) for kind in ("task", "session")]
        print(f"  {window:>6}: {shares[0]:.0%}, {shares[1]:.0%}")


def _escalating(conversations: Sequence[Conversation], profile: Sequence[tuple[int, int]], kind: str, window: int) -> float:
    rows = [(f, last) for c, (f, last) in zip(conversations, profile) if c.kind == kind]
    return sum(f < 0.6 * window and last > window for f, last in rows) / len(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (once) and summarise the AgentDojo workload.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions-per-suite", type=int, default=BuildParams().sessions_per_suite)
    args = parser.parse_args(argv)
    params = BuildParams(seed=args.seed, sessions_per_suite=args.sessions_per_suite)
    conversations = load_agentdojo(params)
    print(agentdojo_build.cache_path(params))
    _print_summary(conversations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
