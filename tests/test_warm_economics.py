"""The break-even gate: the pure forecast and decision, and a Session that gates its warms on real servers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import Backend, RoutePolicy, Session
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.errors import ConfigurationError
from agentkv.testing import FakeClock
from agentkv.warm import (
    CooldownMap, TurnSample, WarmAheadPolicy, decide_break_even, decide_warm, forecast_escalation,
)
from conftest import chat_requests


def linear(turns, *, start=1000, growth=100, pace=60.0):
    """A conversation of ``turns`` requests growing by ``growth`` tokens every ``pace`` seconds."""
    return [TurnSample(i * pace, start + i * growth) for i in range(turns)]


def test_forecast_extrapolates_mean_growth_and_pace():
    """1,200 tokens growing 100 per 60 s reach a 1,750 boundary in 6 turns, 360 s."""
    forecast = forecast_escalation(linear(3), boundary_tokens=1750)
    assert forecast is not None
    assert (forecast.turns, forecast.seconds, forecast.tokens_per_turn, forecast.seconds_per_turn) == (6, 360.0, 100, 60)


def test_forecast_edges():
    """One sample gives no forecast; a flat conversation never escalates; one past the boundary escalates now."""
    assert forecast_escalation(linear(1), boundary_tokens=2000) is None
    flat = forecast_escalation(linear(4, growth=0), boundary_tokens=2000)
    assert flat is not None and flat.turns is None and flat.seconds is None
    past = forecast_escalation(linear(3), boundary_tokens=1100)
    assert past is not None and (past.turns, past.seconds) == (0, 0.0)


def test_decision_fires_inside_the_lifetime_only():
    """An escalation forecast at 360 s fires under a 600 s lifetime and is skipped under a 300 s one."""
    history = linear(3)
    assert decide_break_even(history, boundary_tokens=1750, lifetime_s=600) == "fire"
    assert decide_break_even(history, boundary_tokens=1750, lifetime_s=300) == "break_even"
    assert decide_break_even(linear(3, growth=-5), boundary_tokens=1750, lifetime_s=1e9) == "break_even"
    assert decide_break_even(linear(1), boundary_tokens=1750, lifetime_s=1) == "no_history"
    assert decide_break_even(linear(2), boundary_tokens=1750, lifetime_s=600, min_samples=3) == "no_history"


def test_decide_warm_applies_the_gate_only_when_asked():
    """The gate is off by default; on, a slow conversation's warm says "break_even" and a fast one's fires."""
    slow, fast = linear(3, start=1260, growth=20, pace=300), linear(3, start=900, growth=200, pace=30)
    args = dict(estimated_tokens=1300, fast_window=2048, routed_role="fast", enabled=True, model_known=True,
                boundary_tokens=1792)
    assert decide_warm(policy=WarmAheadPolicy(), history=slow, **args).outcome == "fire"
    gated = WarmAheadPolicy(break_even=True, cache_lifetime_s=600)
    assert decide_warm(policy=gated, history=slow, **args).outcome == "break_even"
    assert decide_warm(policy=gated, history=fast, **args).outcome == "fire"
    assert decide_warm(policy=gated, history=slow[-1:], **args).outcome == "fire"  # no history: seed behaviour
    assert decide_warm(policy=gated, history=slow, **{**args, "estimated_tokens": 100}).outcome == "below_threshold"


def test_gate_settings_are_validated():
    """A non-positive lifetime and a growth window under two turns are refused by name."""
    with pytest.raises(ConfigurationError, match="cache_lifetime_s"):
        WarmAheadPolicy(cache_lifetime_s=0)
    with pytest.raises(ConfigurationError, match="growth_turns"):
        WarmAheadPolicy(growth_turns=1)


@pytest.mark.parametrize("field, value", [
    ("cache_lifetime_s", math.nan), ("cache_lifetime_s", -1.0), ("cache_lifetime_s", "600"), ("cooldown_s", math.nan),
    ("timeout_s", math.nan), ("break_even", "yes"), ("enabled", 1), ("growth_turns", 2.5),
])
def test_bad_gate_settings_raise_configuration_error_naming_the_field(field, value):
    """NaN (which slips past ``<= 0``), a string or a non-bool switch is refused as a ConfigurationError by name."""
    with pytest.raises(ConfigurationError, match=f"WarmAheadPolicy.{field}"):
        WarmAheadPolicy(**{field: value})


def test_an_infinite_lifetime_is_accepted_and_fires_on_any_growth():
    """``cache_lifetime_s=inf`` (a cache that never evicts) is a valid setting: any growing conversation warms."""
    assert decide_break_even(linear(3, growth=1, pace=3600), boundary_tokens=5000,
                             lifetime_s=WarmAheadPolicy(cache_lifetime_s=math.inf).cache_lifetime_s) == "fire"


def test_a_truncated_conversation_is_forecast_from_its_regrowth():
    """An agent that compacts its history and then grows fast again warms: the samples before the shrink are
    not averaged into its growth (they would read as shrinking); a shrink on the newest turn reads the window."""
    truncated = [TurnSample(0, 1700), TurnSample(30, 1750), TurnSample(60, 1000), TurnSample(90, 1200),
                 TurnSample(120, 1400)]
    assert decide_break_even(truncated, boundary_tokens=1792, lifetime_s=600) == "fire"
    forecast = forecast_escalation(truncated, boundary_tokens=1792)
    assert forecast is not None and (forecast.turns, forecast.tokens_per_turn) == (2, 200)
    just_shrunk = truncated[:3]
    assert decide_break_even(just_shrunk, boundary_tokens=1792, lifetime_s=1e9) == "break_even"
    dipped = [TurnSample(0, 1000), TurnSample(30, 1200), TurnSample(60, 1400), TurnSample(90, 1380)]
    assert decide_break_even(dipped, boundary_tokens=1792, lifetime_s=600) == "fire"  # a count's dip is no veto


histories = st.lists(st.tuples(st.floats(0, 3600), st.integers(0, 5000)), min_size=2, max_size=8).map(
    lambda rows: [TurnSample(t, n) for t, n in zip(sorted(r[0] for r in rows), (r[1] for r in rows))])


@given(histories, st.integers(1, 8000), st.floats(1, 1e5), st.floats(1, 1e5))
def test_a_longer_lifetime_never_turns_a_warm_away(history, boundary, short, extra):
    """If the gate fires under some lifetime, it fires under every longer one."""
    if decide_break_even(history, boundary_tokens=boundary, lifetime_s=short) == "fire":
        assert decide_break_even(history, boundary_tokens=boundary, lifetime_s=short + extra) == "fire"


@given(st.integers(1, 500), st.floats(1, 600), st.integers(2, 8), st.integers(0, 4000), st.integers(1, 8000))
def test_linear_growth_forecasts_exactly(growth, pace, turns, start, boundary):
    """For a conversation growing linearly, the forecast is ceil(remaining / growth) turns of the pace."""
    forecast = forecast_escalation(linear(turns, start=start, growth=growth, pace=pace), boundary_tokens=boundary)
    last = start + (turns - 1) * growth
    expected = max(0, math.ceil((boundary - last) / growth))
    assert forecast is not None and forecast.turns == expected
    assert forecast.seconds == pytest.approx(expected * pace)


@given(histories, st.integers(1, 8000))
def test_the_forecast_reads_only_the_growth_since_the_last_shrink(history, boundary):
    """Whatever preceded the conversation's last shrink, the forecast equals the one of the samples since it."""
    drops = [i for i in range(1, len(history)) if history[i].tokens < history[i - 1].tokens]
    tail = history[drops[-1]:] if drops and drops[-1] <= len(history) - 2 else history
    assert forecast_escalation(history, boundary_tokens=boundary) == forecast_escalation(tail, boundary_tokens=boundary)
    if drops and drops[-1] <= len(history) - 2:
        assert forecast_escalation(history, boundary_tokens=boundary).tokens_per_turn >= 0


@given(histories, st.integers(1, 8000), st.floats(1, 1e5), st.floats(0.01, 1))
def test_a_faster_pace_never_turns_a_warm_away(history, boundary, lifetime, factor):
    """Compressing the same growth into less time never turns a fired warm into a skip."""
    faster = [TurnSample(s.at_s * factor, s.tokens) for s in history]
    if decide_break_even(history, boundary_tokens=boundary, lifetime_s=lifetime) == "fire":
        assert decide_break_even(faster, boundary_tokens=boundary, lifetime_s=lifetime) == "fire"


def test_session_gates_a_slow_conversation_and_warms_a_fast_one(fresh):
    """A conversation told 900 s between turns (longer than the cache lives) never warms; told 30 s, it warms once."""
    fast_backend = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow_backend = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    policy = WarmAheadPolicy(break_even=True, cache_lifetime_s=600, growth_turns=4)
    outcomes = {}
    for pace in (900.0, 30.0):
        clock, agent = FakeClock(), ScriptedAgent(result_rows=3)
        messages = agent.opening()
        with Session(fast_backend, slow_backend, discovery=fresh["discovery"], in_flight=fresh["in_flight"],
                     cooldowns=CooldownMap(timer=clock), clock=clock, warm_ahead=policy, tenant=f"gate-{pace}",
                     session_id=f"{fresh['session_id']}-{pace}", cache_salt_secret="k") as s:
            while s.last_route is None or s.last_route.role == "fast":
                s.completion(messages=messages, tools=TOOLS[:8], max_tokens=2)
                clock.advance(pace)
                messages = messages + agent.next_turn()
            assert s.drain_warms(30)
            assert len(s._parts.warm.turns) == 4  # the history the gate keeps is bounded
        outcomes[pace] = s.stats(), [e.warm for e in s.ledger]
    slow_stats, slow_warms = outcomes[900.0]
    fast_stats, fast_warms = outcomes[30.0]
    assert slow_stats["warm_fired"] == 0 and slow_stats["warm_skipped_break_even"] >= 1, slow_warms
    assert fast_stats["warm_fired"] == 1 and fast_stats.get("warm_skipped_break_even", 0) == 0, fast_warms
    assert len([b for b in chat_requests(fresh["slow"]) if b.get("max_tokens") == 1]) == 1


async def test_async_observe_gates_through_the_same_history():
    """The async twin keeps the same bounded history: a slow pace says "break_even", a fast one fires one raw warm."""
    from agentkv import WindowDiscovery
    from agentkv.testing import FakeHttp, models_answer
    from agentkv.warm import InFlightLimit

    http = FakeHttp(lambda method, url, body: models_answer("big", 100_000) if method == "GET" else {"choices": []})
    fast = Backend("hosted_vllm/small", api_base="http://127.0.0.1:9/v1", name="fast", window=1000)
    slow = Backend("hosted_vllm/big", api_base="http://127.0.0.1:8/v1", name="slow")
    policy = WarmAheadPolicy(break_even=True, cache_lifetime_s=600, growth_turns=3)
    outcomes = {}
    for pace in (900.0, 30.0):
        clock = FakeClock()
        async with Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, count_with_server=False,
                           cooldowns=CooldownMap(timer=clock), in_flight=InFlightLimit(4), clock=clock,
                           warm_ahead=policy, routing=RoutePolicy(output_floor=16, min_output=16)) as s:
            seen = []
            for words in (300, 450, 600, 750, 900):
                seen.append((await s.aobserve(messages=[{"role": "user", "content": "word " * words}])).warm)
                clock.advance(pace)
            await s.adrain_warms(10)
        outcomes[pace] = seen
    assert "fire" not in outcomes[900.0] and "break_even" in outcomes[900.0], outcomes
    assert outcomes[30.0].count("fire") == 1 and "break_even" not in outcomes[30.0], outcomes
    assert len([c for c in http.calls if c.method == "POST"]) == 1


def _economics_bench():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "warm_economics.py"
    spec = importlib.util.spec_from_file_location("warm_economics_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_benchmark_population_is_seeded_and_its_accounting_holds(servers):
    """The benchmark's population repeats per seed; on real servers cold spends no warm prefill, the same sessions
    escalate in both modes, and no session is credited with more warm tokens read than it prefilled."""
    bench = _economics_bench()
    import sys

    argv, sys.argv = sys.argv, ["warm_economics.py", "--sessions", "4", "--max-turns", "7", "--rows-median", "6"]
    try:
        args = bench.parse()
    finally:
        sys.argv = argv
    plans = bench.population(args)
    assert plans == bench.population(args) and all(p.turns >= 3 for p in plans)
    (cold,) = bench.play([bench.Mode("cold", WarmAheadPolicy(enabled=False), args, FakeClock(0), servers=servers)], plans)
    (warm,) = bench.play([bench.Mode("cooldown-only", WarmAheadPolicy(), args, FakeClock(0), servers=servers)], plans)
    assert sum(s.warm_prefill for s in cold.sessions) == 0 and sum(s.warms for s in warm.sessions) >= 1
    assert [s.escalated_turn for s in cold.sessions] == [s.escalated_turn for s in warm.sessions]
    assert any(s.escalated_turn is not None for s in warm.sessions)
    assert all(0 <= s.warm_tokens_read <= s.warm_prefill for s in warm.sessions)


def test_every_counter_the_warm_docs_name_is_in_a_fresh_sessions_stats():
    """``Session.stats()`` has each ``warm_*`` counter docs/warm-ahead.md names (the gate's included) at 0 from
    the start, so a dashboard reading ``warm_skipped_break_even`` works before the gate first skips."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "warm-ahead.md").read_text()
    named = set(re.findall(r"`(warm_(?:skipped_[a-z_]+|fired|failed|completed|rewarm_evicted|top_up))`", doc))
    assert "warm_skipped_break_even" in named
    with Session(Backend("hosted_vllm/small", api_base="http://127.0.0.1:9/v1", window=1000),
                 Backend("hosted_vllm/big", api_base="http://127.0.0.1:8/v1"), cache_salt=False) as s:
        stats = s.stats()
    assert {name: stats.get(name) for name in named} == dict.fromkeys(named, 0)


@pytest.mark.parametrize("clock", [5, "monotonic", __import__("datetime").datetime.now])
def test_a_bad_clock_is_refused_when_the_session_is_made(clock):
    """A clock that is not callable, or returns no number (``datetime.now``), raises ConfigurationError naming
    ``Session.clock`` at construction, before any request or network call (not later, out of a request)."""
    from agentkv.testing import FakeHttp

    http = FakeHttp(lambda method, url, body: pytest.fail(f"no call expected, got {method} {url}"))
    with pytest.raises(ConfigurationError, match="Session.clock"):
        Session(Backend("hosted_vllm/small", api_base="http://127.0.0.1:9/v1", window=1000),
                Backend("hosted_vllm/big", api_base="http://127.0.0.1:8/v1"), cache_salt=False, http=http,
                clock=clock, warm_ahead=WarmAheadPolicy(break_even=True))
    assert http.calls == []
