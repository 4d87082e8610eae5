"""Routing against real vLLM 0.32: windows, estimate-first, proactive routing, the silent clamp, warm-ahead, salts.

The tier's tokenizer counts English at about 2.3x cl100k's rate, far outside the estimate's documented 15%:
every test here starts from a fresh estimate bound (as a fresh process does) and a fresh window discovery, so
what it proves does not depend on what earlier tests taught the process. Prompts carry a uuid.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from agentkv import Backend, RoutePolicy, Session, WindowDiscovery
from agentkv.testing import capture_events
from agentkv.warm import WarmAheadPolicy

SENTENCE = "The committee reviewed the quarterly report and agreed that customer satisfaction improved despite delays. "
FLOOR = RoutePolicy().output_floor
BLOCK = 128  # vLLM's CPU backend caches KV in blocks of 128 tokens


@pytest.fixture(autouse=True)
def fresh_bounds(monkeypatch):
    """No estimate bound learned yet: the process-wide bounds as a newly started process has them."""
    monkeypatch.setattr("agentkv.tokens.bound._SHARED", {})


def backend(server, **kwargs):
    return Backend(server.litellm_model, api_base=server.base_url, name=server.model, **kwargs)


def session(fast, slow, *, fast_window=None, **kwargs):
    """An estimate-first Session on the real pair, with a discovery of its own."""
    kwargs.setdefault("warm_ahead", WarmAheadPolicy(enabled=False))
    return Session(backend(fast, window=fast_window), backend(slow), discovery=WindowDiscovery(), **kwargs)


def tokenize(server, messages):
    """The server's exact count of a chat prompt (its /tokenize, generation prompt included)."""
    body = {"model": server.model, "messages": messages, "add_generation_prompt": True}
    return int(httpx.post(f"{server.root}/tokenize", json=body, timeout=30).json()["count"])


class Prose:
    """English prose under a unique tag, sized in the server's own tokens (two /tokenize calls calibrate it)."""

    def __init__(self, server):
        self.server, self.tag = server, uuid.uuid4().hex
        one, eleven = tokenize(server, self.messages(1)), tokenize(server, self.messages(11))
        self.per_sentence = (eleven - one) / 10
        self.base = one - self.per_sentence

    def messages(self, sentences, tag=""):
        return [{"role": "user", "content": f"[{self.tag}{tag}] " + SENTENCE * sentences}]

    def sized(self, tokens, tag=""):
        """A one-message prompt of about ``tokens`` tokens (within a sentence's worth)."""
        return self.messages(max(1, round((tokens - self.base) / self.per_sentence)), tag)


def expected_role(exact, window=2048):
    return "slow" if exact + FLOOR > window else "fast"


def usage(response):
    return response.usage


# --------------------------------------------------------------------------- windows


def test_windows_are_discovered_from_both_servers(vllm_fast, vllm_slow):
    """GET /v1/models gives fast's 2048 and slow's 8192, each server listing its model."""
    discovery = WindowDiscovery()
    fast, slow = discovery.window(backend(vllm_fast)), discovery.window(backend(vllm_slow))
    assert (fast.window, fast.source, fast.model_known) == (2048, "server", True)
    assert (slow.window, slow.source, slow.model_known) == (8192, "server", True)


# --------------------------------------------------------------------------- estimate first, exact where it matters


def test_estimate_first_never_sends_fast_what_the_exact_count_routes_to_slow(vllm_fast, vllm_slow):
    """A sweep of prompt sizes across fast's route boundary (2048 - 256) and window, shuffled: every request goes
    where its exact /tokenize count sends it, and none pays a 400."""
    prose = Prose(vllm_fast)
    targets = [1500, 2300, 1760, 1950, 1820, 1230, 1790, 2080]
    prompts = [prose.sized(t, f"-{i}") for i, t in enumerate(targets)]
    exact = [tokenize(vllm_fast, p) for p in prompts]
    assert min(exact) < 2048 - FLOOR < max(exact) and max(exact) > 2048
    with session(vllm_fast, vllm_slow) as s:
        for messages in prompts:
            s.completion(messages=messages, max_tokens=1)
    sent = [row.backend for row in s.ledger]
    assert sent == [expected_role(n) for n in exact], list(zip(exact, sent, [row.input_tokens for row in s.ledger]))
    assert s.stats()["overflow_errors"] == 0 and s.stats()["reactive_escalations"] == 0


def test_a_prompt_over_fast_window_goes_straight_to_slow(vllm_fast, vllm_slow):
    """A ~2.3K-token prompt (estimated at about 1K) is routed to slow before anything is sent: no 400 paid."""
    messages = Prose(vllm_fast).sized(2300)
    assert tokenize(vllm_fast, messages) > 2048
    with session(vllm_fast, vllm_slow) as s:
        s.completion(messages=messages, max_tokens=1)
    assert (s.last_route.role, s.last_route.reason) == ("slow", "proactive")
    assert s.stats()["overflow_errors"] == 0 and s.stats()["requests"] == {"slow": 1}


# --------------------------------------------------------------------------- the output budget


def test_a_silent_server_clamp_is_recorded_and_the_next_request_routed_right(vllm_fast, vllm_slow):
    """With fast's window declared as 4096, a prompt of ~1.7K tokens and max_tokens=1000 fits on paper; vLLM cuts
    the budget silently (200, "length", fewer tokens): recorded as a server clamp, and the next request, routed
    with the window re-read from the server (2048), is clamped by agentkv so the server cuts nothing."""
    messages = Prose(vllm_fast).sized(1700)
    prompt = tokenize(vllm_fast, messages)
    assert 2048 - prompt >= RoutePolicy().min_output and prompt + 1000 > 2048
    extra = {"extra_body": {"ignore_eos": True}}
    with session(vllm_fast, vllm_slow, fast_window=4096) as s, capture_events() as events:
        cut = s.completion(messages=messages, max_tokens=1000, **extra)
        assert usage(cut).completion_tokens == 2048 - prompt < 1000 and cut.choices[0].finish_reason == "length"
        assert s.stats()["server_clamps"] == 1
        (warning,) = [e for e in events if e["event"] == "server_clamp"]
        assert (warning["max_tokens"], warning["prompt_tokens"], warning["server_window"]) == (1000, prompt, 2048)
        answer = s.completion(messages=messages, max_tokens=1000, **extra)
    assert (s.last_route.reason, s.last_route.window, s.last_route.max_tokens) == ("clamped", 2048, 2048 - prompt)
    assert usage(answer).completion_tokens == s.last_route.max_tokens and s.stats()["server_clamps"] == 1


def test_with_the_real_window_agentkv_decides_the_budget_and_the_server_never_cuts_it(vllm_fast, vllm_slow):
    """Prompts around fast's route boundary with max_tokens=400 (over what fast leaves them): each is clamped by
    the Session to exactly what the window leaves, or sent to slow with its budget, and every answer carries all
    the tokens the Session asked for (the server clamped none)."""
    prose = Prose(vllm_fast)
    prompts = [prose.sized(t, f"-{i}") for i, t in enumerate([1690, 1760, 1850])]
    exact = [tokenize(vllm_fast, p) for p in prompts]
    assert all(n + 400 > 2048 for n in exact) and {expected_role(n) for n in exact} == {"fast", "slow"}
    extra = {"extra_body": {"ignore_eos": True}}
    with session(vllm_fast, vllm_slow) as s:
        answers = []
        for messages in prompts:
            answers.append((s.completion(messages=messages, max_tokens=400, **extra), s.last_route))
    for n, (answer, route) in zip(exact, answers):
        if expected_role(n) == "fast":
            assert (route.reason, route.max_tokens) == ("clamped", 2048 - n)
        else:
            assert (route.role, route.max_tokens) == ("slow", 400)
        assert usage(answer).completion_tokens == route.max_tokens
    assert s.stats()["server_clamps"] == 0 and s.stats()["overflow_errors"] == 0


# --------------------------------------------------------------------------- warm-ahead


def test_warm_ahead_fires_on_the_first_turn_at_60_percent_and_is_reused_at_escalation(vllm_fast, vllm_slow):
    """A growing conversation in a fresh process: the warm fires on the first turn whose exact count reaches
    60% of fast's window (not a turn late), and the escalated turn on slow reuses at least 90% of the warmed
    prompt's tokens (cached_tokens)."""
    prose = Prose(vllm_fast)
    messages = prose.sized(950, "-0")
    turns = []
    with session(vllm_fast, vllm_slow, warm_ahead=WarmAheadPolicy()) as s:
        for turn in range(1, 12):
            s.completion(messages=messages, max_tokens=1)
            assert s.drain_warms(30)
            turns.append((list(messages), tokenize(vllm_fast, messages), s.ledger[-1]))
            if s.ledger[-1].backend == "slow":
                break
            messages = messages + [{"role": "assistant", "content": f"Noted, part {turn}."},
                                   *prose.messages(4, f"-{turn}")]
    counts = [n for _, n, _ in turns]
    first_over = next(i for i, n in enumerate(counts) if n >= 0.6 * 2048)
    assert [row.warm == "fire" for _, _, row in turns].index(True) == first_over, counts
    assert sum(row.warm == "fire" for _, _, row in turns) == 1
    escalated = turns[-1][2]
    assert escalated.backend == "slow" and escalated.reason == "proactive"
    warmed_tokens = tokenize(vllm_slow, turns[first_over][0])
    assert escalated.cached_tokens is not None and escalated.cached_tokens % BLOCK == 0
    assert escalated.cached_tokens / warmed_tokens >= 0.9, (escalated.cached_tokens, warmed_tokens)


# --------------------------------------------------------------------------- tenants


def test_salts_isolate_tenants_on_slow(vllm_fast, vllm_slow):
    """The same prompt on slow: the tenant that sent it before gets cached tokens, another tenant gets none."""
    messages = Prose(vllm_slow).sized(2600)
    prompt = tokenize(vllm_slow, messages)

    def cached(tenant):
        with session(vllm_fast, vllm_slow, tenant=tenant, cache_salt_secret="tier-secret") as s:
            s.completion(messages=messages, max_tokens=1)
        assert s.last_route.role == "slow"
        return s.ledger[-1].cached_tokens

    first = cached("tenant-a")
    again, other = cached("tenant-a"), cached("tenant-b")
    assert first == 0 and other == 0
    assert again is not None and again >= (prompt - 1) // BLOCK * BLOCK
