"""The AgentDojo workload: the loader's format checks on hand-made lines, and (where the agentdojo venv exists) the
builder's conversations and determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # benchmarks/ is not installed: import it from the checkout
    sys.path.insert(0, str(_ROOT))

from benchmarks.workloads import agentdojo_build  # noqa: E402
from benchmarks.workloads.load import SCHEMA, WorkloadError, read_workload, validate, venv_python  # noqa: E402


def _line(**changes: Any) -> dict[str, Any]:
    """A one-task conversation: system, user, one call and its result, the final answer."""
    call = {"id": "call_a", "type": "function", "function": {"name": "get_balance", "arguments": "{}"}}
    line: dict[str, Any] = {
        "schema": SCHEMA, "id": "banking/user_task_0", "suite": "banking", "kind": "task", "tasks": ["user_task_0"],
        "tools": [{"type": "function", "function": {"name": "get_balance", "description": "", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": "You assist."},
            {"role": "user", "content": "What is my balance?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_a", "content": "1810.0"},
            {"role": "assistant", "content": "1810.0"},
        ],
        "requests": [[2, 4]], "tool_errors": 0,
    }
    line.update(changes)
    return line


def test_a_valid_file_loads_and_replays_each_request_with_the_messages_before_it(tmp_path: Path) -> None:
    """Each request sends the messages before its index and is answered by the message at it."""
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(_line()) + "\n\n")
    [conversation] = read_workload(path)
    requests = list(conversation.replay())
    assert [len(r.messages) for r in requests] == [2, 4]
    assert requests[0].answer["tool_calls"][0]["id"] == "call_a"
    assert requests[1].messages[-1]["role"] == "tool" and requests[1].answer["content"] == "1810.0"


def test_a_tool_call_without_its_result_is_refused() -> None:
    """A call whose tool message is missing breaks the format."""
    messages = _line()["messages"]
    with pytest.raises(WorkloadError, match="never answered"):
        validate(_line(messages=messages[:3], requests=[[2]]))


def test_a_result_for_another_call_is_refused() -> None:
    """A tool message must answer a pending call by its id."""
    line = _line()
    line["messages"][3]["tool_call_id"] = "call_b"
    with pytest.raises(WorkloadError, match="answers no pending call"):
        validate(line)


@pytest.mark.parametrize(
    ("requests", "match"),
    [([[1, 4]], "not answered by an assistant"), ([[4]], "not any request's answer"), ([[4, 2]], "must increase")],
)
def test_request_indices_must_point_at_every_assistant_answer_in_order(requests: list[list[int]], match: str) -> None:
    """Requests are the increasing indices of all the assistant messages."""
    with pytest.raises(WorkloadError, match=match):
        validate(_line(requests=requests))


def test_another_schema_is_refused() -> None:
    """A line of another format version is refused rather than misread."""
    with pytest.raises(WorkloadError, match="schema"):
        validate(_line(schema="agentkv.workload.agentdojo/0"))


_PYTHON = venv_python()


@pytest.mark.skipif(_PYTHON is None, reason="no agentdojo venv (set AGENTKV_AGENTDOJO_VENV, or build it with load.py)")
def test_the_builder_answers_every_call_and_writes_the_same_bytes_twice(tmp_path: Path) -> None:
    """Two builds under different hash seeds write identical files whose every tool call has its tool message."""
    args = ["--suites", "workspace,banking", "--sessions-per-suite", "2", "--max-tasks", "4"]
    runs = [
        subprocess.Popen([str(_PYTHON), agentdojo_build.__file__, "--out", str(tmp_path / f"{seed}.jsonl"), *args],
                         env={**os.environ, "PYTHONHASHSEED": seed}, stdout=subprocess.DEVNULL)
        for seed in ("1", "2")
    ]
    assert [run.wait(timeout=60) for run in runs] == [0, 0]
    first, second = (tmp_path / "1.jsonl").read_bytes(), (tmp_path / "2.jsonl").read_bytes()
    assert first == second
    conversations = read_workload(tmp_path / "1.jsonl")
    assert {c.kind for c in conversations} == {"task", "session"}
    for c in conversations:
        for i, message in enumerate(c.messages):
            for j, call in enumerate(message.get("tool_calls") or ()):
                assert c.messages[i + 1 + j] == {**c.messages[i + 1 + j], "role": "tool", "tool_call_id": call["id"]}
                json.loads(call["function"]["arguments"])
        assert {t["function"]["name"] for t in c.tools} >= {
            call["function"]["name"] for m in c.messages for call in m.get("tool_calls") or ()}
