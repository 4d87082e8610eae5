"""What is counted and warmed is what is sent: content blocks, litellm's tool-schema stripping, an on-time first warm."""

import copy
import json
import subprocess
import sys
import textwrap

import httpx
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from agentkv import Backend, Session
from agentkv.integrations.langchain import AgentKVCallbackHandler
from agentkv.testing import capture_events
from agent_checks import shared_prefix, the_warm, tokenize
from conftest import chat_requests

STRICT_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a topic.", "strict": True,
    "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"],
                   "additionalProperties": False}}}


def make_session(fresh, **kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"],
                   session_id=fresh["session_id"], **kwargs)


def test_content_blocks_are_counted_as_chatopenai_sends_them(fresh):
    """A message of several text blocks is counted exactly as the server counts ChatOpenAI's request, and a
    missing cache_salt is warned about once."""
    blocks = [{"type": "text", "text": f"Block {i}: the disk latency rose on host {i}."} for i in range(6)]
    messages = [SystemMessage("You are careful."), HumanMessage(content=blocks)]
    # count_exactly: every turn is counted by the server (a short turn far from any boundary would otherwise be
    # decided on its estimate and byte ceiling, and recorded as the estimate)
    with make_session(fresh, tenant="t", cache_salt_secret="k", count_exactly=True) as s, \
            capture_events() as events:
        handler = AgentKVCallbackHandler(s)
        model = ChatOpenAI(model=fresh["fast"].model_id, base_url=fresh["fast"].api_base, api_key="-", max_tokens=2)
        answers = [model.invoke(messages, config={"callbacks": [handler]}) for _ in range(2)]
    assert s.ledger[-1].input_tokens == answers[-1].usage_metadata["input_tokens"]
    assert chat_requests(fresh["fast"])[-1]["messages"][1]["content"] == blocks
    assert [e["event"] for e in events].count("cache_salt_missing") == 1


def test_strict_tool_schemas_are_counted_and_warmed_as_litellm_sends_them(fresh):
    """Session.completion counts a strict tool as litellm sends it to hosted_vllm (stripped), and the warm
    carries the same schema, so the escalated request's tokens start with the warm's."""
    filler = [{"role": "user", "content": f"Record {i}: " + "latency rose on the storage hosts. " * 12}
              for i in range(20)]
    with make_session(fresh) as s:
        for n in range(2, 21, 2):
            answer = s.completion(messages=filler[:n], tools=[STRICT_TOOL], max_tokens=4)
            assert s.ledger[-1].input_tokens == answer.usage.prompt_tokens
            if s.last_route.role == "slow":
                break
            assert s.drain_warms(30)
    warm, escalated = the_warm(fresh["slow"]), chat_requests(fresh["slow"])[-1]
    assert "strict" not in json.dumps(warm["tools"]) and warm["tools"] == escalated["tools"]
    warm_ids = tokenize(fresh["slow"], warm)
    assert shared_prefix(warm_ids, tokenize(fresh["slow"], escalated)) >= 0.95 * len(warm_ids)


def test_the_first_warm_in_a_process_does_not_import_litellm(fresh):
    """In a fresh process, the first warm (from an observer) reaches slow without importing litellm."""
    code = textwrap.dedent(f"""
        import sys
        from agentkv import Backend, Session
        fast = Backend("hosted_vllm/{fresh['fast'].model_id}", api_base="{fresh['fast'].api_base}", name="fast")
        slow = Backend("hosted_vllm/{fresh['slow'].model_id}", api_base="{fresh['slow'].api_base}", name="slow")
        messages = [{{"role": "user", "content": "latency rose on the storage hosts. " * 200}}]
        with Session(fast, slow) as s:
            s.observe(messages=messages, max_tokens=4)
            assert s.drain_warms(60)
        print(s.stats()["warm_fired"], s.stats()["warm_completed"], "litellm" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-3:] == ["1", "1", "False"], out.stderr[-2000:]
    assert len([b for b in chat_requests(fresh["slow"]) if b.get("max_tokens") == 1]) == 1


def test_the_transport_warm_is_the_callers_body(fresh):
    """Through the transport the warm is the caller's body with a one-token budget, no stream, slow's model and the salt."""
    from agentkv.integrations.openai import AgentKVTransport

    messages = [{"role": "user", "content": [{"type": "text", "text": "latency rose. " * 350}]}]
    body = {"model": fresh["fast"].model_id, "messages": messages, "tools": [STRICT_TOOL], "max_tokens": 4,
            "temperature": 0.5}
    with make_session(fresh, tenant="t", cache_salt_secret="k") as s:
        with httpx.Client(transport=AgentKVTransport(s)) as client:
            client.post(fresh["fast"].api_base + "/chat/completions", json=body).raise_for_status()
        assert s.drain_warms(30)
    expected = {**body, "model": fresh["slow"].model_id, "max_tokens": 1, "cache_salt": s._parts.cache_salt}
    assert the_warm(fresh["slow"]) == expected


def test_the_sessions_stripped_tools_are_rebuilt_only_when_the_callers_change():
    """Equal tools reuse the previous request's stripped list; a schema edited in place is stripped again;
    the caller's objects are never edited."""
    from agentkv._session.attempts import LitellmSends, as_litellm_sends

    sends, tools = LitellmSends(), [copy.deepcopy(STRICT_TOOL)]
    first = sends("hosted_vllm/m", {"tools": tools, "max_tokens": 4})
    again = sends("hosted_vllm/m", {"tools": [copy.deepcopy(STRICT_TOOL)]})
    assert first["tools"] is again["tools"] and first["tools"] == as_litellm_sends("hosted_vllm/m", {"tools": tools})["tools"]
    tools[0]["function"]["description"] = "Edited in place."
    edited = sends("hosted_vllm/m", {"tools": tools})
    assert edited["tools"] is not first["tools"] and edited["tools"][0]["function"]["description"] == "Edited in place."
    assert tools[0]["function"].get("strict") is STRICT_TOOL["function"].get("strict")
    assert sends("openai/gpt-4o", {"tools": tools})["tools"] is tools
