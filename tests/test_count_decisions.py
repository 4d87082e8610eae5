"""Estimate first, exact where it matters: every decision equals the all-exact path's on every traced turn."""

import importlib.util
import pathlib
import random

import pytest

from agentkv.backends import Backend
from agentkv.demo.script import TOOLS as DEMO_TOOLS
from agentkv.demo.script import ScriptedAgent
from agentkv.errors import ContextOverflowError
from agentkv.routing import RoutePolicy, Target, decide_route, interval_decides
from agentkv import Session
from agentkv.testing import capture_events
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE
from agentkv.tokens import Payload, TemplateSource, TiktokenSource
from agentkv.warm.policy import WarmAheadPolicy, decide_warm

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICY, WARM = RoutePolicy(), WarmAheadPolicy()


def _accounting_module():
    spec = importlib.util.spec_from_file_location("accounting_bench", ROOT / "benchmarks" / "accounting.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accounting_convs():
    bench = _accounting_module()
    msgs = bench.trace()
    return [(msgs[:n], bench.TOOLS) for n in range(1, len(msgs) + 1)]


def warm_ahead_convs(rows=15, turns=24):
    agent, convs = ScriptedAgent(result_rows=rows), []
    msgs = agent.opening()
    for _ in range(turns):
        msgs = msgs + agent.next_turn()
        convs.append((msgs, DEMO_TOOLS))
    return convs


PIECES = ["hello world ", "def f(x):\n    return x * 2\n", "数据库连接失败。", "😀🎉 ", "  \n\n", "1234567890 ",
          '{"k": [1, 2, 3]}\n', "Straße naïve café ", "<|im_end|> ", "\t- item\n"]


def random_convs(n=200, seed=14):
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 20)))}]
        for _ in range(rng.randint(1, 14)):
            msgs.append({"role": rng.choice(["user", "assistant", "tool"]),
                         "content": "".join(rng.choice(PIECES) for _ in range(rng.randint(0, rng.choice([8, 80, 800]))))})
        convs.append((msgs, DEMO_TOOLS[:rng.randint(0, len(DEMO_TOOLS))]))
    return convs


def decisions(route_tokens, safe_tokens, max_tokens, fast, slow):
    """Everything decided from a count: backend, role, reason, budget, note and the warm-ahead outcome."""
    try:
        d = decide_route(route_tokens=route_tokens, safe_tokens=safe_tokens, max_tokens=max_tokens, fast=fast,
                         slow=slow, policy=POLICY)
    except ContextOverflowError:
        return "refused"
    warm = decide_warm(estimated_tokens=route_tokens, fast_window=fast.window, routed_role=d.role, enabled=True,
                       model_known=True, policy=WARM)
    return d.backend, d.role, d.reason, d.max_tokens, d.note, warm.outcome


def compare(convs, windows, budgets, exact_source):
    """Per turn and configuration: the estimate-first decisions equal the exact ones; returns (turns, exact asks)."""
    estimator, turns, asked = TiktokenSource(), 0, 0
    for msgs, tools in convs:
        payload = Payload(tuple(msgs), tuple(tools) or None)
        exact = exact_source.count(payload).total
        estimate = estimator.count(payload)
        low, high = estimate.interval
        assert low <= exact <= high, (low, exact, high)
        for fast_w, slow_w in windows:
            fast, slow = Target("fast", fast_w), Target("slow", slow_w)
            for budget in budgets:
                turns += 1
                want = decisions(exact, exact, budget, fast, slow)
                if interval_decides(low, high, max_tokens=budget, fast=fast, slow=slow, policy=POLICY,
                                    warm_threshold=WARM.threshold):
                    got = decisions(estimate.total, estimate.safe, budget, fast, slow)
                else:
                    asked += 1
                    got = want
                assert got == want, (len(msgs), fast_w, slow_w, budget, estimate, exact)
    return turns, asked


# The embedded servers' tokenizer (cl100k with the ChatML tools template) and a different vocabulary.
EXACT_SOURCES = {"cl100k": TemplateSource("cl100k_base", incremental=False),
                 "o200k": TemplateSource("o200k_base", incremental=False)}


@pytest.mark.parametrize("vocab", sorted(EXACT_SOURCES))
def test_accounting_trace_decisions_equal_the_exact_ones(vocab):
    """Over the 100K-token accounting trace, deciding on the estimate where it suffices changes no decision."""
    windows = [(8192, 131072), (32768, 131072), (65536, 131072), (32768, 65536), (None, 131072)]
    turns, asked = compare(accounting_convs(), windows, [None, 4, 4096], EXACT_SOURCES[vocab])
    assert asked < turns / 2  # most turns are far from every boundary


@pytest.mark.parametrize("vocab", sorted(EXACT_SOURCES))
def test_warm_ahead_trace_decisions_equal_the_exact_ones(vocab):
    """Over the warm-ahead benchmark's conversation, routes, clamps and warms are those of the exact count."""
    compare(warm_ahead_convs(), [(16384, 32768), (8192, 16384), (4096, 8192)], [None, 4, 2048],
            EXACT_SOURCES[vocab])


@pytest.mark.parametrize("vocab", sorted(EXACT_SOURCES))
def test_random_conversations_decisions_equal_the_exact_ones(vocab):
    """Over 200 seeded random conversations (code, CJK, emoji, whitespace runs), no decision differs."""
    compare(random_convs(), [(512, 2048), (1024, 4096), (2048, 16384), (4096, 5000)], [None, 1, 300],
            EXACT_SOURCES[vocab])


def test_an_interval_across_a_boundary_needs_the_exact_count():
    """Each boundary (warm threshold, route, fast clamp, slow refusal, slow clamp) forces the exact count."""
    fast, slow = Target("fast", 10_000), Target("slow", 20_000)
    decides = lambda low, high, budget=None: interval_decides(  # noqa: E731
        low, high, max_tokens=budget, fast=fast, slow=slow, policy=POLICY, warm_threshold=0.6)
    assert decides(1000, 5000) and decides(6000, 9000) and decides(10_000, 19_000)
    assert not decides(5000, 6000)  # warm threshold at 6000
    assert not decides(9700, 9800)  # route boundary at 9744
    assert not decides(7000, 8000, 2500) and decides(7000, 7400, 2500)  # clamp when count + 2500 > 10000
    assert not decides(19_000, 19_900)  # slow refuses above 19744
    assert not decides(12_000, 13_000, 7500) and decides(12_000, 12_400, 7500)  # slow clamp above 12500
    assert interval_decides(0, 10**9, max_tokens=None, fast=Target("fast", None), slow=slow)


def test_sessions_route_identically_with_fewer_tokenize_calls(servers):
    """Two Sessions on the embedded servers, estimate-first and all-exact, route every turn alike."""
    fast_server, slow_server = servers
    fast_server.max_model_len, slow_server.max_model_len = 2048, 16384
    fast = Backend(f"hosted_vllm/{fast_server.model_id}", api_base=fast_server.api_base, name="fast")
    slow = Backend(f"hosted_vllm/{slow_server.model_id}", api_base=slow_server.api_base, name="slow")
    agent = ScriptedAgent(result_rows=1)
    msgs, routes = agent.opening(), {}
    convs = []
    for _ in range(16):
        msgs = msgs + agent.next_turn()
        convs.append(msgs)
    for exactly in (False, True):
        fast_server.clear_requests()
        with Session(fast, slow, count_exactly=exactly) as s:
            routes[exactly] = [_route(s, m) for m in convs]
        routes[exactly, "tokenize"] = len([r for r in fast_server.requests if r.path == "/tokenize"])
    assert routes[False] == routes[True] and {r[1] for r in routes[True]} == {"fast", "slow"}
    assert routes[False, "tokenize"] < routes[True, "tokenize"]


def _route(session, msgs):
    d = session.route(messages=msgs, tools=DEMO_TOOLS, max_tokens=600)
    return d.backend, d.role, d.reason, d.max_tokens


# A server whose template writes every message's content twice: its counts are about twice cl100k's, far
# outside the estimate's documented 15% bound.
DOUBLING_TEMPLATE = CHATML_TOOLS_TEMPLATE.replace("(message.content or '')",
                                                  "(message.content or '') + (message.content or '')")


@pytest.fixture(scope="module")
def doubling_server():
    from agentkv.embedded.engine.codec import TiktokenCodec
    from agentkv.embedded.server import LocalServer

    assert DOUBLING_TEMPLATE != CHATML_TOOLS_TEMPLATE
    with LocalServer.from_size("tiny", window=4096, model_id="doubling-tiny",
                               codec=TiktokenCodec(template=DOUBLING_TEMPLATE)) as server:
        yield server


def _prose(sentences, tag):
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": " ".join(f"Host {tag}-{i} saw latency rise after compaction." for i in range(sentences))}]


def test_a_first_exact_count_outside_the_interval_widens_it_for_later_turns(doubling_server):
    """Against a server counting twice what cl100k does, the first request (the ratio still unknown) is counted
    exactly instead of being routed on a safe-looking estimate; the count falls outside the interval and widens
    it, so later Sessions on that server route as the all-exact path does and still decide small turns on the
    estimate alone."""
    fast = Backend("hosted_vllm/doubling-tiny", api_base=doubling_server.api_base, name="fast")
    slow = Backend("hosted_vllm/big", api_base="http://127.0.0.1:9/v1", window=65536, name="slow")  # never called

    def session(**kwargs):
        return Session(fast, slow, warm_ahead=WarmAheadPolicy(threshold=0.95), count_with_server=True, **kwargs)

    short, near, small = _prose(190, "a"), _prose(310, "b"), _prose(20, "c")  # estimates ~2.1K, ~3.5K, ~0.3K
    with session() as first, capture_events() as events:
        assert first.route(messages=short).role == "slow"  # counted exactly: ~4.2K, over 4096 - 256
        assert first._parts.counters["fast"].exact_asked == 1
    assert [e for e in events if e["event"] == "count_bound_exceeded"][0]["widened_by"] > 1.5
    with session() as after, session(count_exactly=True) as exact:
        decision = after.route(messages=near)
        assert decision == exact.route(messages=near) and decision.role == "slow"
        routed, counted = after.route(messages=small), exact.route(messages=small)
        assert (routed.backend, routed.reason) == (counted.backend, counted.reason) == ("fast", "fits")
        assert routed.count_source == "tiktoken" and after._parts.counters["fast"].exact_asked == 1
