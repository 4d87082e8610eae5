"""The ReAct helper: model calls through the Session's routing, tool execution, errors as tool messages."""

import asyncio
import json

import pytest

from agentkv import Backend, ConfigurationError, Session
from agentkv.react import Tool, arun_loop, assistant_message, resolve, run_loop, tool_calls, toolset
from agentkv.testing import ScriptedReplies
from agentkv.toolschema import function_schema
from conftest import chat_requests


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


async def slow_add(a: int, b: int) -> int:
    """Add two integers, eventually.

    Args:
        a: The first.
        b: The second.
    """
    await asyncio.sleep(0)
    return a + b


def calls(*pairs):
    """A scripted assistant turn that calls tools: pairs of (name, arguments as a dict or a raw string)."""
    return [(name, args if isinstance(args, str) else json.dumps(args)) for name, args in pairs]


class ScriptedClient:
    """A litellm-shaped client answering from a script: a string is a final answer, a list is tool calls."""

    def __init__(self, script):
        self.script = list(script)
        self.requests = []

    def completion(self, **kwargs):
        self.requests.append(json.loads(json.dumps(kwargs, default=str)))
        step = self.script.pop(0)
        if isinstance(step, str):
            message = {"role": "assistant", "content": step}
        else:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{len(self.requests)}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(step)]}
        return {"choices": [{"message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}

    async def acompletion(self, **kwargs):
        return self.completion(**kwargs)


def offline_session(script, window=8192):
    """A Session on a declared-window backend with a scripted client: no server, no network."""
    client = ScriptedClient(script)
    return Session(Backend("hosted_vllm/offline", window=window, name="fast"), client=client), client


def test_final_answer_on_the_first_step():
    """A reply without tool calls ends the loop with stop reason "final_answer"."""
    s, client = offline_session(["Paris."])
    result = run_loop(s, "Capital of France?", [add], max_tokens=16)
    assert (result.stop_reason, result.steps, result.content) == ("final_answer", 1, "Paris.")
    assert result.messages == [{"role": "user", "content": "Capital of France?"}, result.final]
    assert client.requests[0]["max_tokens"] == 16 and client.requests[0]["tools"] == [function_schema(add)]


def test_tool_calls_are_run_and_answered_in_order():
    """Every tool call gets a tool message with its id and result, and the next request carries them."""
    s, client = offline_session([calls(("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})), "5 and 2"])
    result = s.react("Add things.", [add])
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [("call_1_0", "5"), ("call_1_1", "2")]
    assert client.requests[1]["messages"] == result.messages[:-1]
    assert result.steps == 2 and [r.backend for r in result.routes] == ["fast", "fast"]


def test_a_raising_tool_becomes_an_error_message():
    """A tool that raises answers its call with the error, and the loop goes on to the final answer."""
    s, _ = offline_session([calls(("explode", {"reason": "disk on fire"})), "sorry"])
    result = run_loop(s, "Go.", [explode])
    assert result.messages[2]["content"] == "error: explode raised RuntimeError: disk on fire"
    assert result.stop_reason == "final_answer"


@pytest.mark.parametrize(("name", "arguments", "error"), [
    ("nope", "{}", "error: unknown tool 'nope'; available tools: add"),
    ("add", "{not json", "error: the arguments of 'add' are not valid JSON"),
    ("add", "[1, 2]", "error: the arguments of 'add' must be a JSON object, got list"),
    ("add", '{"a": 1}', "error: add raised TypeError"),
])
def test_bad_calls_become_error_messages(name, arguments, error):
    """Unknown tools, malformed or non-object JSON and wrong arguments are answered with an error, not raised."""
    s, _ = offline_session([calls((name, arguments)), "ok"])
    result = run_loop(s, "Go.", {"add": add})
    assert result.messages[2]["role"] == "tool" and result.messages[2]["content"].startswith(error)


def test_max_steps_stops_the_loop_with_its_calls_answered():
    """At max_steps the loop stops with "max_steps", and the last step's tool calls still have answers."""
    s, client = offline_session([calls(("add", {"a": 1, "b": 1}))] * 3)
    result = run_loop(s, "Loop forever.", [add], max_steps=3)
    assert (result.stop_reason, result.steps, len(client.requests)) == ("max_steps", 3, 3)
    assert result.messages[-1]["role"] == "tool" and result.final["tool_calls"]


def test_system_prompt_and_history():
    """The system prompt goes first unless the history has one; the user's turn goes last."""
    s, client = offline_session(["a", "b"])
    run_loop(s, "Second?", system="Be brief.", messages=[{"role": "user", "content": "First"}])
    run_loop(s, {"role": "user", "content": "Again"}, system="ignored",
             messages=[{"role": "system", "content": "Kept."}])
    assert [m["content"] for m in client.requests[0]["messages"]] == ["Be brief.", "First", "Second?"]
    assert [m["content"] for m in client.requests[1]["messages"]] == ["Kept.", "Again"]
    assert "tools" not in client.requests[0]


def test_explicit_schema_replaces_the_derived_one():
    """A schema dict in the tool list is advertised for the callable of the same name."""
    schema = {"type": "function", "function": {"name": "add", "description": "Sum.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    assert toolset([add, schema])["add"].schema == schema
    assert toolset({"plus": add})["plus"].schema["function"]["name"] == "plus"
    assert list(toolset({"ignored": Tool.of(add, schema=schema)})) == ["add"]  # a Tool keeps its own name
    with pytest.raises(ConfigurationError, match="no callable"):
        toolset([{**schema, "function": {**schema["function"], "name": "other"}}])


def test_sync_loop_refuses_async_tools():
    """run_loop names async tools and points at arun_loop instead of leaving coroutines unawaited."""
    s, _ = offline_session(["never"])
    with pytest.raises(ConfigurationError, match=r"\['slow_add'\].*arun_loop"):
        run_loop(s, "Go.", [slow_add])


async def test_async_loop_awaits_async_tools_and_runs_sync_ones():
    """arun_loop awaits async tools, calls sync tools directly, and Session.arun delegates to it."""
    s, _ = offline_session([calls(("slow_add", {"a": 2, "b": 2}), ("add", {"a": 1, "b": 2})), "4 and 3"])
    result = await s.areact("Add.", [slow_add, add], max_steps=4)
    assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["4", "3"]
    s2, _ = offline_session([calls(("explode", {"reason": "x"})), "done"])
    result2 = await arun_loop(s2, "Go.", [explode])
    assert result2.messages[2]["content"].startswith("error: explode raised") and result2.content == "done"


def test_response_parsing_fills_missing_ids_and_dict_arguments():
    """A tool call without an id gets call_<step>_<i>, and dict arguments are serialised as JSON."""
    response = {"choices": [{"message": {"content": None, "tool_calls": [
        {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}}]}
    message = assistant_message(response, step=4)
    assert message == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_4_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    tool, arguments = resolve(tool_calls(message)[0], toolset([Tool.of(add)]))
    assert tool.name == "add" and arguments == {"a": 1, "b": 2}


def test_loop_escalates_to_slow_as_tool_results_grow(fresh):
    """Against the embedded servers, a loop whose tool results outgrow fast is routed to slow mid-run, onto a warm prefix."""
    def fetch_logs(host: str) -> str:
        """Fetch a host's logs.

        Args:
            host: The host name.
        """
        return "\n".join(f"{host} 2026-11-29T0{i % 10}:00:00Z osd slow request id={i:04d} blocked for 31s"
                         for i in range(16))

    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    client = ScriptedReplies([calls(("fetch_logs", {"host": f"st-{i}"})) for i in range(3)] + ["It was compaction."])
    with Session(fast, slow, client=client, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                 in_flight=fresh["in_flight"], session_id=fresh["session_id"]) as s:
        result = s.react("Why is eu-west slow?", [fetch_logs], max_steps=8, max_tokens=2)
        s.drain_warms(30)
    roles = [r.role for r in result.routes]
    assert result.stop_reason == "final_answer" and result.content == "It was compaction."
    assert roles[0] == "fast" and roles[-1] == "slow" and roles == sorted(roles)  # fast..., then slow...
    warmed = next(e for e in s.ledger if e.warm == "fire")
    assert s.stats()["escalations"] == 1 and s.ledger[-1].cached_tokens >= 0.8 * warmed.input_tokens
    assert len(chat_requests(fresh["fast"])) == roles.count("fast")
