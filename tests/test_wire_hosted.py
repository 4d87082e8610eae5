"""The pure parts of escalating to a hosted model: which kind of server a backend is, where cache marks go, what a
warm costs and saves, and the hosted providers' overflow wordings."""

import math

import pytest

from agentkv import Backend
from agentkv.providers.prices import CacheUsage, Prices, read_saving, request_cost
from agentkv.errors import ConfigurationError
from agentkv.overflow import parse_overflow
from agentkv.providers import provider_of
from agentkv.warm.economics import EscalationRate, warm_premium
from agentkv.warm.policy import WarmAheadPolicy, decide_warm
from agentkv.wire.hosted import (
    MAX_BREAKPOINTS, anthropic_marked, caller_marks, explicit_cache_moves, gemini_marked, openai_keyed,
)
from agentkv.wire.usage import Usage

SONNET = Prices(input=3e-6, output=1.5e-5, cache_write=3.75e-6, cache_read=3e-7)


@pytest.mark.parametrize(("model", "api_base", "kind"), [
    ("anthropic/claude-sonnet-4-5", "http://proxy.internal", "anthropic"),
    ("anthropic/claude-sonnet-4-5", None, "anthropic"),
    ("gemini/gemini-2.5-pro", "http://127.0.0.1:9/v1beta", "gemini"),
    ("openai/gpt-5.6", "http://gateway.internal/v1", "vllm"),
    ("openai/gpt-oss-20b", "http://10.0.0.5:8000/v1", "vllm"),
    ("openai/gpt-5.6", None, "openai"),
    ("openai/qwen3-8b", "http://127.0.0.1:8001/v1", "vllm"),
    ("openai/qwen3-8b", "https://api.openai.com/v1", "openai"),
    ("hosted_vllm/qwen3-32b", "http://10.0.0.2:8000/v1", "vllm"),
    ("bedrock/anthropic.claude-3", None, "managed"),
    ("azure/my-deployment", "https://x.openai.azure.com", "managed"),
    ("claude-sonnet-4-5", None, "anthropic"),
    ("gpt-4o", None, "openai"),
])
def test_the_kind_of_backend_follows_litellms_provider_not_api_base(model, api_base, kind):
    """An anthropic/ model behind an api_base is Anthropic; openai/ is OpenAI's API only at OpenAI's host (litellm's
    route to any OpenAI-compatible server otherwise, vLLM serving gpt-oss among them: its tenants keep their salt)."""
    assert provider_of(model, api_base) == kind
    backend = Backend(model, api_base=api_base)
    assert backend.provider_kind == kind and backend.self_hosted == (kind == "vllm")


def test_a_declared_provider_wins_and_bad_settings_are_refused():
    """Backend(provider=...) overrides the model string; retention and explicit caches are checked per provider."""
    assert Backend("openai/gpt-5.6", api_base="http://proxy/v1", provider="openai").provider_kind == "openai"
    with pytest.raises(ConfigurationError, match="provider"):
        Backend("openai/x", provider="bedrock")
    with pytest.raises(ConfigurationError, match="cache_retention"):
        Backend("anthropic/claude-sonnet-4-5", cache_retention="24h")
    with pytest.raises(ConfigurationError, match="cache_retention"):
        Backend("gemini/gemini-2.5-pro", cache_retention="1h")
    with pytest.raises(ConfigurationError, match="explicit_cache"):
        Backend("anthropic/claude-sonnet-4-5", explicit_cache=True)
    assert Backend("gemini/gemini-2.5-pro", cache_retention="3600s", explicit_cache=True).explicit_cache


def conversation():
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Why is checkout slow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "sql", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rows"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "sql", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "more rows"},
    ]


TOOLS = [{"type": "function", "function": {"name": "sql", "parameters": {"type": "object"}}}]


def test_anthropic_marks_the_end_the_last_write_the_system_prompt_and_the_tools():
    """Four breakpoints: the request's end, the warm's end, the system prompt, the last tool; the caller's untouched."""
    call = {"messages": conversation(), "tools": TOOLS}
    marked = anthropic_marked(call, cache_end=4)
    messages = marked["messages"]
    assert [i for i, m in enumerate(messages) if m.get("cache_control")] == [0, 3, 5]
    assert marked["tools"][-1]["cache_control"] == {"type": "ephemeral"} and caller_marks(marked) == MAX_BREAKPOINTS
    assert "cache_control" not in call["messages"][5] and "cache_control" not in TOOLS[0]


def test_anthropic_keeps_the_callers_marks_within_four():
    """Three marks of the caller's leave room for one, the request's end, at the caller's lifetime (Anthropic wants
    1-hour entries before 5-minute ones: a 1-hour retention would break that order after the caller's 5-minute)."""
    messages = conversation()
    messages[1] = {**messages[1], "content": [{"type": "text", "text": "Why?", "cache_control": {"type": "ephemeral"}}]}
    messages[0] = {**messages[0], "cache_control": {"type": "ephemeral"}}
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]
    marked = anthropic_marked({"messages": messages, "tools": tools}, cache_end=4, ttl="1h")
    assert caller_marks(marked) == 4 and marked["messages"][5]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in marked["messages"][3]
    assert caller_marks(anthropic_marked(marked, cache_end=4)) == 4
    assert anthropic_marked({"messages": conversation()}, cache_end=4, ttl="1h")["messages"][5]["cache_control"] == {
        "type": "ephemeral", "ttl": "1h"}


def test_every_place_litellm_carries_a_mark_from_counts():
    """Marks on a tool's function, a tool call, the top level, extra_body and litellm's injection points count."""
    messages = conversation()
    messages[2] = {**messages[2], "tool_calls": [{**messages[2]["tool_calls"][0], "cache_control": {"type": "ephemeral"}}]}
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "cache_control": {"type": "ephemeral"}}}]
    call = {"messages": messages, "tools": tools, "cache_control": {"type": "ephemeral"},
            "cache_control_injection_points": [{"location": "message", "role": "system"}]}
    assert caller_marks(call) == 4 and anthropic_marked(call, cache_end=4) == call


def test_a_caller_mixing_lifetimes_gets_no_marks_added():
    """A caller whose marks mix 1-hour and 5-minute entries keeps Anthropic's order to themselves."""
    messages = conversation()
    messages[0] = {**messages[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    messages[1] = {**messages[1], "cache_control": {"type": "ephemeral"}}
    assert anthropic_marked({"messages": messages}, cache_end=4) == {"messages": messages}


def test_no_mark_where_litellm_would_drop_it_or_anthropic_refuse_it():
    """An assistant turn of tool calls alone, or an empty last text block, takes no mark: the one before does."""
    messages = conversation()[:5]  # ends on an assistant turn of tool calls
    assert [i for i, m in enumerate(anthropic_marked({"messages": messages}, cache_end=None)["messages"])
            if m.get("cache_control")] == [0, 3]
    empty = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": ""}]}]
    assert [i for i, m in enumerate(anthropic_marked({"messages": empty}, cache_end=None)["messages"])
            if m.get("cache_control")] == [0]


def test_openai_gets_the_conversations_key_unless_the_caller_set_one():
    """prompt_cache_key is the routing key; a caller's own key and retention win."""
    assert openai_keyed({"messages": []}, routing_key="k1", retention="24h") == {
        "messages": [], "prompt_cache_key": "k1", "prompt_cache_retention": "24h"}
    assert openai_keyed({"prompt_cache_key": "mine"}, routing_key="k1", retention=None) == {"prompt_cache_key": "mine"}


def test_gemini_marks_through_the_last_user_turn_of_the_last_write():
    """Gemini's explicit cache cannot end on a model turn: marks run through the last user message before cache_end."""
    messages = conversation() + [{"role": "user", "content": "And now?"}]
    marked = gemini_marked({"messages": messages}, cache_end=6, ttl="600s")["messages"]
    assert [i for i, m in enumerate(marked) if m.get("cache_control")] == [0, 1]
    assert marked[0]["content"][0]["cache_control"] == {"type": "ephemeral", "ttl": "600s"}  # where litellm reads it
    assert gemini_marked({"messages": messages}, cache_end=None) == {"messages": messages}
    assert [i for i, m in enumerate(gemini_marked({"messages": messages}, cache_end=7)["messages"])
            if m.get("cache_control")] == list(range(7))


def test_an_explicit_cache_moves_once_its_tail_outgrows_it():
    """A slow turn moves the explicit cache when its uncached tail is as long as the cached prefix."""
    assert not explicit_cache_moves(Usage(prompt_tokens=3000, cached_tokens=2000))
    assert explicit_cache_moves(Usage(prompt_tokens=4000, cached_tokens=2000))
    # litellm counts a cache created on the way into the prompt: it is no tail
    assert not explicit_cache_moves(Usage(prompt_tokens=5000, cached_tokens=2000, cache_write_tokens=2000))
    assert explicit_cache_moves(Usage(prompt_tokens=1500, cached_tokens=None))


def test_a_requests_cost_and_its_reads_saving_at_claudes_prices():
    """Uncached, written, read and output tokens each at their price; the read saves input minus read."""
    usage = CacheUsage(prompt_tokens=3000, cache_write=800, cache_read=2000, completion_tokens=10)
    assert request_cost(usage, SONNET) == pytest.approx(200 * 3e-6 + 800 * 3.75e-6 + 2000 * 3e-7 + 10 * 1.5e-5)
    assert read_saving(usage, SONNET) == pytest.approx(2000 * 2.7e-6)


def test_a_warms_premium_is_what_it_costs_beyond_what_it_saves():
    """At Claude's 5-minute prices a sure escalation makes a warm cost 8% more; half of them, 108%."""
    assert warm_premium(SONNET, escalation_rate=1.0, writes_own_cache=True) == pytest.approx(0.08)
    assert warm_premium(SONNET, escalation_rate=0.5, writes_own_cache=True) == pytest.approx(1.08)
    assert math.isinf(warm_premium(SONNET, escalation_rate=0.0, writes_own_cache=True))
    gpt51 = Prices(input=1.25e-6, output=1e-5, cache_write=1.25e-6, cache_read=1.25e-7)
    assert warm_premium(gpt51, escalation_rate=1.0, writes_own_cache=False) == pytest.approx(0.1)


def test_the_escalation_rate_learns_from_crossings():
    """(escalated + 1) / (crossed + 2): 0.5 before evidence, near 0.9 after nine escalations in ten."""
    rate = EscalationRate()
    assert rate.rate == 0.5
    for i in range(10):
        rate.cross()
        if i:
            rate.escalate()
    assert rate.rate == pytest.approx(10 / 12)


def test_the_warm_decision_skips_below_the_minimum_and_over_the_premium():
    """decide_warm: "below_cache_minimum" under a hosted model's minimum; "cost" over a cost-aware policy's premium."""
    inputs = dict(estimated_tokens=1300, fast_window=2048, routed_role="fast", enabled=True, model_known=True)
    assert decide_warm(policy=WarmAheadPolicy(), min_cacheable=4096, **inputs).outcome == "below_cache_minimum"
    policy = WarmAheadPolicy(cost_aware=True, max_premium=0.25)
    assert decide_warm(policy=policy, premium=1.08, **inputs).outcome == "cost"
    assert decide_warm(policy=policy, premium=0.08, **inputs).outcome == "fire"
    assert decide_warm(policy=policy, premium=None, **inputs).outcome == "fire"
    assert decide_warm(policy=WarmAheadPolicy(), premium=1.08, **inputs).outcome == "fire"
    with pytest.raises(ConfigurationError, match="max_premium"):
        WarmAheadPolicy(max_premium=-1)


@pytest.mark.parametrize(("text", "window", "prompt"), [
    ("prompt is too long: 205123 tokens > 200000 maximum", 200000, 205123),
    ("This model's maximum context length is 272000 tokens. However, your messages resulted in 280001 tokens.",
     272000, 280001),
    ("The input token count (1048577) exceeds the maximum number of tokens allowed (1048576).", 1048576, 1048577),
])
def test_hosted_providers_overflow_wordings_are_parsed(text, window, prompt):
    """Anthropic's, OpenAI's and Gemini's overflow errors give the window and the prompt's length."""
    overflow = parse_overflow(text)
    assert overflow is not None and overflow.max_context == window and overflow.prompt_tokens == prompt
    assert not overflow.prompt_is_lower_bound


def test_a_hosted_request_carries_no_salt_and_a_self_hosted_one_keeps_it():
    """request_kwargs: vLLM serving gpt-oss behind openai/ keeps the tenant's salt; Claude and OpenAI get none (a
    caller's own neither), and no extra_body left empty."""
    from agentkv._session.attempts import request_kwargs

    kwargs = {"messages": conversation(), "extra_body": {"cache_salt": "callers"}}
    vllm = request_kwargs(Backend("openai/gpt-oss-20b", api_base="http://10.0.0.5:8000/v1"), kwargs, "tenant-salt",
                          max_tokens=None)
    assert vllm["extra_body"] == {"cache_salt": "tenant-salt"}
    for model in ("anthropic/claude-sonnet-4-5", "openai/gpt-5.6"):
        hosted = request_kwargs(Backend(model), kwargs, "tenant-salt", max_tokens=None, keep_caller_salt=True,
                                routing_key="k")
        assert "extra_body" not in hosted and "cache_salt" not in hosted
    assert kwargs["extra_body"] == {"cache_salt": "callers"}


def test_the_transport_refuses_backends_it_cannot_address():
    """The OpenAI-SDK transport sends OpenAI bodies to each backend's URL: a Claude backend, or a slow one without an
    api_base, is refused before anything is sent."""
    from agentkv import Session
    from agentkv.integrations.openai import AgentKVTransport

    fast = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", name="fast")
    with pytest.raises(ConfigurationError, match="anthropic"):
        AgentKVTransport(Session(fast, Backend("anthropic/claude-sonnet-4-5", name="slow")))
    with pytest.raises(ConfigurationError, match="api_base"):
        AgentKVTransport(Session(fast, Backend("openai/gpt-5.6", name="slow")))
    AgentKVTransport(Session(fast, Backend("openai/gpt-5.6", api_base="https://api.openai.com/v1", name="slow")))
