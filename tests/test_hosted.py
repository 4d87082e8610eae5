"""Escalating to a hosted model, through litellm's real provider code against the provider fakes: the warm writes the
provider's prompt cache, the escalated turn reads it, counts come from the count endpoints, and stats price it all."""

import asyncio
import copy

import pytest

from agentkv import Backend, Session, WarmAheadPolicy
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.errors import ContextOverflowError
from agentkv.testing.providers.anthropic import FakeAnthropic
from agentkv.testing.providers.gemini import FakeGemini
from agentkv.testing.providers.openai import FakeOpenAI
from agentkv.testing import capture_events
from agentkv.tokens import Payload
from agentkv.tokens.sources import AnthropicCountSource, GeminiCountSource

TOOLS8 = TOOLS[:8]


def react(turns):
    """A growing tool-using conversation (one user message, then assistant tool calls and tool results)."""
    return ScriptedAgent(result_rows=1).conversation(turns)


def chat(turns):
    """A growing chat whose every request ends on a user message (what a Gemini explicit cache can end on)."""
    msgs = [{"role": "system", "content": "You are an incident analyst. " * 20}]
    history = []
    for t in range(turns):
        words = " ".join(f"service-{t}-{i} latency p99 rose" for i in range(25))
        msgs = msgs + [{"role": "user", "content": f"Question {t}: {words}"}]
        history.append(copy.deepcopy(msgs))
        msgs = msgs + [{"role": "assistant", "content": f"Answer {t}: checked."}]
    return history


def fast_backend(fresh):
    return Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")


def run(session, history, *, slow_turns=3, **kwargs):
    """Send ``history``'s requests until ``slow_turns`` went to slow; the ledger rows of the slow ones."""
    for msgs in history:
        session.completion(messages=msgs, max_tokens=2, **kwargs)
        assert session.drain_warms(30)
        if session.stats()["requests"].get("slow", 0) >= slow_turns:
            break
    return [row for row in session.ledger if row.backend == "slow"]


def warm_and_turns(bodies, budget_key):
    """The warm (the one-token request) and the turns among the bodies a provider fake received."""
    warms = [b for b in bodies if b.get(budget_key) == 1]
    return warms, [b for b in bodies if b.get(budget_key) != 1]


def marks(body):
    """The ``cache_control`` breakpoints in an Anthropic request body."""
    found = sum(1 for tool in body.get("tools") or [] if tool.get("cache_control"))
    system = body.get("system")
    found += sum(1 for block in system if block.get("cache_control")) if isinstance(system, list) else 0
    for message in body["messages"]:
        content = message["content"]
        found += sum(1 for block in content if block.get("cache_control")) if isinstance(content, list) else 0
    return found


def test_anthropic_warm_writes_once_and_the_escalation_reads_it(fresh):
    """Through litellm's Anthropic path: one warm writes the cache, the escalated turn reads all of it, the next slow
    turn reads the escalated turn's prefix; no request carries a salt, an extra_body, or a fifth breakpoint."""
    with FakeAnthropic() as fake, capture_events() as events:
        slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", name="slow")
        with Session(fast_backend(fresh), slow, tenant="acme", cache_salt_secret="k") as s:
            rows = run(s, react(20), tools=TOOLS8)
            stats = s.stats()
    warms, turns = warm_and_turns(fake.requests, "max_tokens")
    assert len(warms) == 1 and len(turns) == 3
    costs = [e for e in events if e["event"] == "warm_cost"]
    written = costs[0]["cache_write"]
    assert written > 0 and stats["warm_cache_write_tokens"] == written
    assert rows[0].cached_tokens >= 0.9 * written and stats["escalation_cache_read_tokens"] == rows[0].cached_tokens
    slow_cached = [e for e in events if e["event"] == "hosted_cache"]
    assert slow_cached[1]["cache_read"] >= slow_cached[0]["prompt"]  # the next turn read the escalated prompt whole
    for body in fake.requests:
        assert 1 <= marks(body) <= 4 and "cache_salt" not in body and "extra_body" not in body
    assert [c.path for c in fake.calls if c.method == "GET"] == []  # no /v1/models: its window is litellm's catalog


def test_anthropic_stats_price_the_warm_and_the_saving(fresh):
    """stats() shows the warm's cost and the escalation's saving at litellm's Sonnet 4.5 prices."""
    with FakeAnthropic() as fake:
        slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", name="slow")
        with capture_events() as events, Session(fast_backend(fresh), slow) as s:
            run(s, react(20), slow_turns=1, tools=TOOLS8)
            stats = s.stats()
    warm = next(e for e in events if e["event"] == "warm_cost")
    escalation = next(e for e in events if e["event"] == "hosted_cache")
    uncached = warm["prompt"] - warm["cache_write"]
    assert stats["warm_cost_usd"] == pytest.approx(warm["cache_write"] * 3.75e-6 + uncached * 3e-6 + 1 * 1.5e-5)
    assert stats["escalation_saved_usd"] == pytest.approx(escalation["cache_read"] * (3e-6 - 3e-7))
    assert stats["cost_usd"] == pytest.approx(warm["cost_usd"] + escalation["cost_usd"])


def test_the_callers_own_breakpoints_are_kept_and_count_toward_four(fresh):
    """A caller who marks three blocks keeps them; agentkv adds at most one, and the provider takes every request."""
    history = []
    for msgs in react(20):
        marked = copy.deepcopy(msgs)
        marked[0] = {**marked[0], "cache_control": {"type": "ephemeral"}}
        marked[1] = {**marked[1], "cache_control": {"type": "ephemeral"}}
        history.append(marked)
    tools = [*copy.deepcopy(TOOLS8[:-1]), {**copy.deepcopy(TOOLS8[-1]), "cache_control": {"type": "ephemeral"}}]
    with FakeAnthropic() as fake:
        slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", name="slow")
        with Session(fast_backend(fresh), slow) as s:
            run(s, history, slow_turns=2, tools=tools)
    assert len(fake.requests) == 3 and all(marks(body) == 4 for body in fake.requests)
    assert all(body["tools"][-1].get("cache_control") for body in fake.requests)


def test_no_warm_below_the_models_cacheable_minimum(fresh):
    """Haiku 4.5 caches from 4,096 tokens: a conversation crossing 60% of a 2,048 window is not warmed."""
    with FakeAnthropic() as fake:
        slow = Backend("anthropic/claude-haiku-4-5", api_base=fake.url, api_key="sk-ant-test", name="slow")
        with Session(fast_backend(fresh), slow) as s:
            run(s, react(20), slow_turns=1, tools=TOOLS8)
            stats = s.stats()
    assert stats["warm_fired"] == 0 and stats["warm_skipped_below_cache_minimum"] >= 1
    assert [b for b in fake.requests if b.get("max_tokens") == 1] == []


def test_the_cost_gate_skips_a_warm_that_costs_more_than_it_saves(fresh):
    """With cost_aware warming and no evidence yet (half the conversations escalate), a warm to Claude costs 1.08x
    what it saves: it is skipped, and nothing is written."""
    with FakeAnthropic() as fake:
        slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test",
                       name=f"slow-gate-{fresh['session_id']}")
        policy = WarmAheadPolicy(cost_aware=True, max_premium=0.25)
        with Session(fast_backend(fresh), slow, warm_ahead=policy) as s:
            for msgs in react(7):
                s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
            stats = s.stats()
    assert stats["warm_skipped_cost"] >= 1 and stats["warm_fired"] == 0
    assert [b for b in fake.requests if b.get("max_tokens") == 1] == []


def test_openai_turns_and_warms_carry_one_prompt_cache_key(fresh):
    """Through litellm's OpenAI path (GPT-5.6): every request carries the conversation's opaque prompt_cache_key and
    the configured retention, lands on one machine, and the escalation reads the warm's write."""
    with FakeOpenAI() as fake:
        slow = Backend("openai/gpt-5.6", api_base=fake.url + "/v1", api_key="sk-test", name="slow",
                       cache_retention="24h", provider="openai")
        with Session(fast_backend(fresh), slow, tenant="acme", cache_salt_secret="k") as s:
            rows = run(s, react(20), tools=TOOLS8)
            key = s.routing_key
    warms, turns = warm_and_turns(fake.requests, "max_completion_tokens")
    assert len(warms) == 1 and len(turns) == 3
    assert {b["prompt_cache_key"] for b in fake.requests} == {key} and "acme" not in key
    assert {b["prompt_cache_retention"] for b in fake.requests} == {"24h"}
    assert all("cache_salt" not in b for b in fake.requests)
    served = fake.served
    assert len({x.machine for x in served}) == 1
    assert served[0].cache_write_tokens > 0 and rows[0].cached_tokens >= 0.9 * served[0].cache_write_tokens
    assert served[2].cached_tokens >= served[1].prompt_tokens - 2  # the next turn read the escalated prompt


def test_gemini_explicit_cache_is_created_once_read_and_deleted_at_close(fresh):
    """Through litellm's Gemini context caching: the warm creates one explicit cache, the escalated and later turns
    name it (reading all of it), and closing the Session deletes it, its storage priced."""
    with FakeGemini() as fake:
        slow = Backend("gemini/gemini-2.5-flash", api_base=fake.url, api_key="g-test", name="slow", explicit_cache=True)
        s = Session(fast_backend(fresh), slow)
        with capture_events() as events:
            rows = run(s, chat(20), slow_turns=2)
            s.close()
            assert s.drain_warms(30)
        creates = [c for c in fake.calls if c.method == "POST" and c.path.endswith("/cachedContents")]
        assert len(creates) == 1 and fake.caches() == [] and len(fake.deleted) == 1
    written = next(e for e in events if e["event"] == "warm_cost")["cache_write"]
    assert written > 0 and rows[0].cached_tokens >= 0.9 * written and rows[1].cached_tokens >= 0.9 * written
    named = [b.get("cachedContent") or b.get("cached_content") for b in fake.requests]
    assert len(set(named)) == 1 and None not in named
    assert s.stats()["warm_cost_usd"] > next(e for e in events if e["event"] == "warm_cost")["cost_usd"]


def test_async_anthropic_escalation_reads_the_warm(fresh):
    """The async path warms as a task and its escalation reads the warm the same way."""
    async def main():
        with FakeAnthropic() as fake:
            slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", name="slow")
            async with Session(fast_backend(fresh), slow) as s:
                for msgs in react(20):
                    await s.acompletion(messages=msgs, tools=TOOLS8, max_tokens=2)
                    await s.adrain_warms(30)
                    if s.last_route.role == "slow":
                        break
                return s.stats(), s.ledger[-1]
    stats, escalated = asyncio.run(main())
    assert stats["warm_completed"] == 1 and escalated.cached_tokens >= 0.9 * stats["warm_cache_write_tokens"] > 0


def _sent_body(fake, model, messages, api_base):
    """What litellm sent for ``messages`` (a one-token request), as the fake received it."""
    import litellm

    litellm.completion(model=model, api_base=api_base, api_key="k-test", messages=messages, tools=TOOLS8, max_tokens=1)
    return fake.requests[-1]


def test_count_endpoints_count_what_litellm_sends_as_the_provider_does():
    """Anthropic's count_tokens and Gemini's countTokens, asked by agentkv's sources, equal each fake's own count of
    the body litellm sends."""
    messages = react(6)[-1]
    with FakeAnthropic() as fake:
        backend = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="k-test")
        sent = _sent_body(fake, backend.model, messages, fake.url)
        counted = AnthropicCountSource(backend).count(Payload(tuple(messages), tuple(TOOLS8)))
        assert counted.exact and counted.total == fake.count(sent) and 0 < counted.tools < counted.total
    with FakeGemini() as gemini:
        backend = Backend("gemini/gemini-2.5-flash", api_base=gemini.url, api_key="k-test")
        sent = _sent_body(gemini, backend.model, messages, gemini.url)
        counted = GeminiCountSource(backend).count(Payload(tuple(messages), tuple(TOOLS8)))
        assert counted.exact and counted.total == gemini.count(sent)


def test_routing_near_a_hosted_window_asks_the_count_endpoint_and_never_sends_a_doomed_request():
    """Two Claude models on the fake with small windows: near each boundary the count endpoint decides, every request
    sent fits its model, and the one that fits neither is refused before it is sent."""
    fast_window, slow_window = 2400, 3400
    with FakeAnthropic(windows={"claude-haiku-4-5": fast_window, "claude-sonnet-4-5": slow_window}) as fake:
        fast = Backend("anthropic/claude-haiku-4-5", api_base=fake.url, api_key="k", name="fast", window=fast_window)
        slow = Backend("anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="k", name="slow", window=slow_window)
        refused = None
        with Session(fast, slow) as s:
            for msgs in react(30):
                try:
                    s.completion(messages=msgs, tools=TOOLS8, max_tokens=16)
                except ContextOverflowError as error:
                    refused = error
                    break
    windows = {"claude-haiku-4-5": fast_window, "claude-sonnet-4-5": slow_window}
    for body in fake.requests:
        assert fake.count(body) + body["max_tokens"] <= windows[body["model"]]
    assert refused is not None and any(c.path.endswith("/count_tokens") for c in fake.calls)
    assert {b["model"] for b in fake.requests} == {"claude-haiku-4-5", "claude-sonnet-4-5"}


def test_gemini_closes_only_the_caches_its_own_requests_created(fresh):
    """Two Sessions on one prefix: the second reads the first's explicit cache and, closing, leaves it; the first's
    close deletes it. Over many slow turns a cache moves only when its tail outgrows it, and none is left behind."""
    with FakeGemini() as fake:
        slow = Backend("gemini/gemini-2.5-flash", api_base=fake.url, api_key="g-test", name="slow", explicit_cache=True)
        first, second = Session(fast_backend(fresh), slow), Session(fast_backend(fresh), slow)
        run(first, chat(40), slow_turns=12)
        created = [c for c in fake.calls if c.method == "POST" and c.path.endswith("/cachedContents")]
        assert 1 <= len(created) <= 3
        run(second, chat(12), slow_turns=1)
        assert len([c for c in fake.calls if c.method == "POST" and c.path.endswith("/cachedContents")]) == len(created)
        second.close()
        assert second.drain_warms(30) and fake.deleted == [] and len(fake.caches()) == len(created)
        first.close()
        assert first.drain_warms(30) and fake.caches() == [] and len(fake.deleted) == len(created)
