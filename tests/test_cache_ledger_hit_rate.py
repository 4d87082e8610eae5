"""The ledger's hit rate, per backend, cross-checked against the embedded server's /metrics over the same window."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

pytest.importorskip("zmq")  # agentkv.cache_ledger subscribes with pyzmq

from agentkv.cache_ledger.hit_rate import HitCounters, compare, server_counters  # noqa: E402

VLLM_TEXT = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0 1733000000000
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
"""


def test_server_counters_sum_vllm_engines_and_read_the_former_names():
    """Both engines' samples add up (a timestamp and _created samples are ignored); pre-0.10 names are read too."""
    assert server_counters(VLLM_TEXT) == HitCounters(1500, 640)
    legacy = "vllm:gpu_prefix_cache_queries_total 80\nvllm:gpu_prefix_cache_hits_total 16\n"
    assert server_counters(legacy) == HitCounters(80, 16)
    with pytest.raises(ValueError, match="prefix_cache_queries_total"):
        server_counters("vllm:num_requests_running 0\n")


def test_compare_reports_unrecorded_traffic_the_gap_and_a_reset():
    """The window's server deltas beside the ledger's: equal agrees; extra server queries show; a drop is a reset."""
    check = compare("b", HitCounters(100, 10), HitCounters(300, 110), HitCounters(5, 5), HitCounters(205, 105),
                    window_s=1.0)
    assert check.agrees and check.gap == 0 and check.unrecorded_queries == 0
    check = compare("b", HitCounters(100, 10), HitCounters(400, 110), HitCounters(0, 0), HitCounters(200, 100),
                    window_s=1.0)
    assert not check.agrees and check.unrecorded_queries == 100 and check.gap == pytest.approx(100 / 300 - 0.5)
    assert compare("b", HitCounters(100, 10), HitCounters(40, 4), HitCounters(), HitCounters(), window_s=1.0).reset


# --- against the embedded server, real traffic -------------------------------------------------------------

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from agentkv.cache_ledger import CacheLedger  # noqa: E402
from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.engine.models import build_model  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402
from agentkv.testing import FakeHttp  # noqa: E402

SYSTEM = "You are a careful agent that reads the whole file before acting. " * 4


@pytest.fixture(scope="module")
def server():
    engine = LocalEngine(build_model("tiny", seed=0), model_id="tiny-hit-rate", max_model_len=1024)
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    with LocalServer(engine, kv_events_config=config) as running:
        yield running


@pytest.fixture
def backend(server):
    return server.backend(kv_events=server.kv_events.endpoint, kv_events_replay=server.kv_events.replay_endpoint)


def ask(server: LocalServer, user: str, salt: str) -> dict[str, Any]:
    body = {"model": server.model_id, "messages": [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": user}],
            "max_tokens": 1, "cache_salt": salt}
    return dict(httpx.post(f"{server.api_base}/chat/completions", json=body, timeout=60).json()["usage"])


def recorded(ledger: CacheLedger, backend: Any, server: LocalServer, user: str, salt: str) -> None:
    usage = ask(server, user, salt)
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    ledger.record(backend, cached, cached, prompt_tokens=int(usage["prompt_tokens"]))


def test_the_ledger_hit_rate_matches_the_server_over_a_window_of_recorded_traffic(server, backend):
    """Every request recorded: the server's /metrics deltas equal the ledger's tokens queried and hit."""
    with CacheLedger([backend]) as ledger:
        assert ledger.cross_check(backend) is None  # opens the window
        for user in ("Read main.py.", "Read utils.py.", "Read main.py."):
            recorded(ledger, backend, server, user, "salt-hit-rate")
        check = ledger.cross_check(backend)
        (stats,) = ledger.stats()
    assert check is not None and check.agrees and check.gap == 0 and check.unrecorded_queries == 0
    assert check.ledger.hits > 0 and check.ledger.queries > check.ledger.hits
    assert (stats.queried_tokens, stats.hit_tokens) == (check.ledger.queries, check.ledger.hits)
    assert stats.hit_rate == check.server.hit_rate


def test_traffic_the_ledger_did_not_record_shows_as_a_disagreement(server, backend):
    """A request the ledger never recorded (another client's, all cache hits) moves the server's rate, not the ledger's."""
    ask(server, "Another client's question.", "salt-other")
    with CacheLedger([backend]) as ledger:
        ledger.cross_check(backend)
        recorded(ledger, backend, server, "A fresh question, never asked before.", "salt-new")
        ask(server, "Another client's question.", "salt-other")  # warm: its prefix hits, and nobody records it
        check = ledger.cross_check(backend)
    assert check is not None and not check.agrees
    assert check.unrecorded_queries > 0 and check.server.hits > check.ledger.hits
    assert check.gap is not None and check.gap > 0


def test_the_async_twin_scrapes_without_blocking_and_windows_chain(server, backend):
    """across_check awaits the seam's async text GET (no sync call), and each call closes the previous window."""
    real = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    fake = FakeHttp(lambda method, url, body: real if url == f"{server.base_url}/metrics" else (404, {}))

    async def twice() -> Any:
        with CacheLedger([backend], http=fake) as ledger:
            await ledger.across_check(backend)
            return await ledger.across_check(backend)

    check = asyncio.run(twice())
    assert check is not None and check.agrees and check.server == HitCounters(0, 0)
    assert [(c.method, c.asynchronous, c.blocking) for c in fake.calls] == [("GET", True, False)] * 2


def metrics_text(queries: int, hits: int, created: float = 1.7e9) -> str:
    """A vLLM-shaped exposition of the two prefix-cache counters (one engine)."""
    labels = '{engine="0",model_name="m"}'
    return (f"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{labels} {queries}.0\n"
            f"vllm:prefix_cache_queries_created{labels} {created}\n"
            f"# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{labels} {hits}.0\n")


def test_a_scrape_overtaken_by_a_later_one_is_dropped_not_read_as_a_reset(backend):
    """Two concurrent cross_checks: the one that started first but answered last closes no window (its counters are
    older than the stored ones), so it neither reports a false reset nor shifts the next window's start."""
    started, release = threading.Event(), threading.Event()
    answers = iter([metrics_text(100, 10), None, metrics_text(300, 30), metrics_text(300, 30)])

    def handler(method: str, url: str, body: Any) -> Any:
        answer = next(answers)
        if answer is None:  # the slow scrape: it began before the next one and returns older counters
            started.set()
            release.wait(10)
            return metrics_text(200, 20)
        return answer

    with CacheLedger([backend], http=FakeHttp(handler)) as ledger:
        ledger.cross_check(backend)
        results: list[Any] = []
        slow = threading.Thread(target=lambda: results.append(ledger.cross_check(backend)))
        slow.start()
        assert started.wait(10)
        fresh = ledger.cross_check(backend)
        release.set()
        slow.join(10)
        after = ledger.cross_check(backend)
    assert fresh is not None and fresh.server == HitCounters(200, 20) and not fresh.reset
    assert results == [None]
    assert after is not None and after.server == HitCounters(0, 0) and not after.reset


@pytest.mark.parametrize("value", ["+Inf", "NaN", "", "12abc"])
def test_a_malformed_or_non_finite_counter_is_a_value_error_without_the_server_text(value):
    """A counter sample that is not a finite number raises ValueError (not OverflowError or IndexError), and the
    message quotes nothing the server sent; other series' odd values (a NaN gauge) are not read at all."""
    text = f"vllm:prefix_cache_queries_total{{engine=\"0\"}} {value}\nvllm:prefix_cache_hits_total 1\n"
    with pytest.raises(ValueError) as raised:
        server_counters(text)
    assert "finite number" in str(raised.value) and (not value or value not in str(raised.value))
    assert server_counters(metrics_text(5, 1) + "vllm:gpu_prefix_cache_hit_rate NaN\n") == HitCounters(5, 1)
    with pytest.raises(ValueError, match="finite number"):  # an unclosed label set
        server_counters('vllm:prefix_cache_queries_total{engine="0" 5\nvllm:prefix_cache_hits_total 1\n')


def test_a_restart_that_outgrew_the_old_counters_is_a_reset_by_its_created_timestamp():
    """A server restarted inside the window whose new counters already exceed the old ones is still a reset when
    vLLM's ``_created`` series changed (an engine's series added later is not one); the window then counts from the
    restart. Without ``_created`` (Prometheus multiprocess mode) only counters that went down show a reset."""
    before, after = server_counters(metrics_text(100, 10)), server_counters(metrics_text(150, 15, created=1.8e9))
    check = compare("b", before, after, HitCounters(), HitCounters(150, 15), window_s=1.0)
    assert check.reset and check.server == HitCounters(150, 15) and not check.agrees
    same = compare("b", before, server_counters(metrics_text(150, 15)), HitCounters(), HitCounters(50, 5), window_s=1.0)
    assert not same.reset and same.agrees
    later = metrics_text(150, 15) + metrics_text(0, 0, created=1.9e9).replace('engine="0"', 'engine="1"')
    assert not compare("b", before, server_counters(later), HitCounters(), HitCounters(50, 5), window_s=1.0).reset
    bare = "vllm:prefix_cache_queries_total 150\nvllm:prefix_cache_hits_total 15\n"
    assert not compare("b", before, server_counters(bare), HitCounters(), HitCounters(50, 5), window_s=1.0).reset


# --- a Session's own traffic, warms included ----------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    """An embedded fast (2048-token window) and slow (16384, publishing KV events) pair."""
    from agentkv.embedded.server import LocalServer

    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    fast = LocalServer.from_size("tiny", window=2048, model_id="hr-fast")
    slow = LocalServer.from_size("tiny", window=16384, model_id="hr-slow", seed=1, kv_events_config=events)
    with fast, slow:
        yield fast, slow


def test_a_sessions_warms_are_recorded_so_the_cross_check_agrees(pair):
    """A Session with a ledger records its warm-ahead requests like its others: over a conversation that warms slow and
    escalates to it, the ledger's tokens queried and hit equal the slow server's /metrics deltas."""
    import uuid

    from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
    from agentkv.warm import CooldownMap, InFlightLimit

    fast, slow = pair
    backends = (Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base, name="fast"),
                Backend(f"hosted_vllm/{slow.model_id}", api_base=slow.api_base, name="slow",
                        kv_events=slow.kv_events.endpoint, kv_events_replay=slow.kv_events.replay_endpoint))
    messages = [{"role": "system", "content": f"{uuid.uuid4()} " + SYSTEM * 15}, {"role": "user", "content": "Start."}]
    with CacheLedger([backends[1]]) as ledger:
        s = Session(*backends, tenant="hit-rate", warm_ahead=WarmAheadPolicy(cooldown_s=0.001),
                    cache_salt_secret="hit-rate-test", discovery=WindowDiscovery(), cooldowns=CooldownMap(),
                    in_flight=InFlightLimit(4), cache_ledger=ledger)
        assert ledger.cross_check(backends[1]) is None
        roles = []
        while "slow" not in roles[-1:] and len(roles) < 12:
            s.completion(messages=messages, max_tokens=2)
            assert s.drain_warms(60)
            roles.append(s.last_route.role)
            messages = messages + [{"role": "assistant", "content": "Done."},
                                   {"role": "user", "content": "Next: " + "read the next file carefully " * 30}]
        check = ledger.cross_check(backends[1])
    stats = s.stats()
    assert roles[-1] == "slow" and stats["warm_completed"] >= 1
    assert check is not None and check.server.queries > 0 and check.server.hits > 0
    assert check.agrees and check.unrecorded_queries == 0 and check.gap == 0
