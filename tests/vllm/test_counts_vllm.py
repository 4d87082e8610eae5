"""Counts equal the real vLLM 0.32 server's ``usage.prompt_tokens`` on every message shape, in server mode
(``/tokenize``) and with the checkpoint's tokenizer and chat template declared on the Backend."""

from __future__ import annotations

import uuid

import httpx
import pytest

from agentkv import Backend, Session
from agentkv.vllm_launch import CHAT_TEMPLATE

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
                                                                       "properties": {"q": {"type": "string"}}}}},
    {"function": {"parameters": {"type": "object", "properties": {}}, "description": "Now.", "name": "clock"},
     "type": "function"},
]


def _call(arguments: str, call_id: str = "call_1", name: str = "get_weather") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _shapes(tag: str) -> dict[str, dict]:
    """Every message shape, each opening with a user turn unique to this run."""
    user = {"role": "user", "content": f"What is the weather like in Paris? ({tag})"}
    asked = [user, {"role": "assistant", "content": None, "tool_calls": [_call('{"city": "Paris", "days": 2}')]}]
    return {
        "plain": {"messages": [user]},
        "system": {"messages": [{"role": "system", "content": "You are terse."}, user]},
        "multi_turn": {"messages": [user, {"role": "assistant", "content": "Sunny."},
                                    {"role": "user", "content": "And tomorrow?"}]},
        "tools": {"messages": [user], "tools": TOOLS},
        "tools_with_system": {"messages": [{"role": "system", "content": "Use tools."}, user], "tools": TOOLS[:2]},
        "call_spaced_args": {"messages": asked, "tools": TOOLS},
        "call_compact_args": {"messages": [user, {"role": "assistant", "content": None,
                                                  "tool_calls": [_call('{"city":"Paris","days":2}')]}],
                              "tools": TOOLS},
        "compact_args_no_tools": {"messages": [user, {"role": "assistant", "content": "Checking.",
                                                      "tool_calls": [_call('{"city":"Paris"}')]}]},
        "indented_args": {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
            _call('{\n  "city": "Paris",\n  "days": 2\n}')]}], "tools": TOOLS},
        "ascii_escaped_args": {"messages": [user, {"role": "assistant", "content": "Checking.",
                                                   "tool_calls": [_call('{"city":"Z\\u00fcrich"}')]}]},
        "parallel_calls": {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
            _call('{"city":"Paris"}'), _call('{"q":"paris events"}', "call_2", "search")]}], "tools": TOOLS},
        "tool_results": {"messages": [*asked, {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "light wind"},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "no rain"},
                                      {"role": "user", "content": "Thanks."}], "tools": TOOLS},
        "tool_result_list": {"messages": [*asked, {"role": "tool", "tool_call_id": "call_1", "content": [
            {"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}]}]},
        "content_list": {"messages": [{"role": "user", "content": [
            {"type": "text", "text": f"Three parts ({tag})."}, {"type": "text", "text": "Second part."},
            {"type": "text", "text": "Third."}]}]},
        "system_list": {"messages": [{"role": "system", "content": [
            {"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}]}, user]},
        "system_list_with_tools": {"messages": [{"role": "system", "content": [
            {"type": "text", "text": "Use tools."}, {"type": "text", "text": "Be brief."}]}, user], "tools": TOOLS},
        "unicode": {"messages": [{"role": "user", "content": f"Grüße aus Zürich, 東京の天気は? 🌦️ naïve café ({tag})"},
                                 {"role": "assistant", "content": "Très bien — 晴れ."},
                                 {"role": "user", "content": "Ünïcödé ☃"}]},
    }


SHAPES = list(_shapes("x"))


@pytest.fixture(scope="module")
def requests_and_usage(vllm_fast):
    """Each shape's request and the prompt tokens the server's chat completion reported for it."""
    shapes = _shapes(uuid.uuid4().hex)
    served = {}
    with httpx.Client(timeout=60) as client:
        for name, request in shapes.items():
            answer = client.post(f"{vllm_fast.base_url}/chat/completions",
                                 json={"model": vllm_fast.model, "max_tokens": 1, **request})
            assert answer.status_code == 200, (name, answer.text[:300])
            served[name] = answer.json()["usage"]["prompt_tokens"]
    return shapes, served


@pytest.fixture(scope="module")
def sessions(vllm_fast):
    """A Session counting through the server's /tokenize, and one counting with the declared tokenizer and template."""
    root = httpx.get(f"{vllm_fast.base_url}/models", timeout=10).json()["data"][0]["root"]
    server = Session(fast=Backend(vllm_fast.litellm_model, api_base=vllm_fast.base_url, window=vllm_fast.window))
    declared = Session(fast=Backend(vllm_fast.litellm_model, api_base=vllm_fast.base_url, window=vllm_fast.window,
                                    tokenizer=root, chat_template=CHAT_TEMPLATE))
    return {"server": server, "template": declared}


@pytest.mark.parametrize("mode", ["server", "template"])
@pytest.mark.parametrize("shape", SHAPES)
def test_count_equals_served_prompt_tokens(requests_and_usage, sessions, mode, shape):
    """Session.count is exact and equals the chat completion's usage.prompt_tokens for this shape."""
    requests, served = requests_and_usage
    count = sessions[mode].count(**requests[shape])
    assert (count.source, count.exact) == (mode, True)
    assert count.total == served[shape], f"{shape}: counted {count.total}, vLLM {served[shape]}"


def test_tool_tokens_agree_between_modes(requests_and_usage, sessions):
    """Both modes attribute the same number of tokens to the tool schemas, and a positive one."""
    requests, _ = requests_and_usage
    server, declared = (sessions[m].count(**requests["tools"]) for m in ("server", "template"))
    assert server.tools == declared.tools > 0
