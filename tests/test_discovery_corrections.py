"""A window a server states in an overflow corrects a declared window that is too large, never one that is smaller."""

from agentkv import Backend, WindowDiscovery
from agentkv.testing import FakeClock, FakeHttp, capture_events, models_answer


def _discovery(clock: FakeClock | None = None) -> WindowDiscovery:
    return WindowDiscovery(timer=clock or FakeClock(), http=FakeHttp(lambda method, url, body: models_answer("m", 2048)))


def test_a_correction_below_a_declared_window_wins_over_it():
    """Backend(window=99999) on a 2048-token server: once an overflow says 2048, the Session's window is 2048."""
    discovery, fast = _discovery(), Backend("hosted_vllm/m", api_base="http://fast/v1", window=99999)
    assert discovery.window(fast).window == 99999
    discovery.correct(fast, 2048)
    info = discovery.window(fast)
    assert (info.window, info.source) == (2048, "corrected")


def test_a_correction_above_a_declared_window_leaves_it():
    """An operator's smaller declared window is kept: a refusal only ever lowers it."""
    discovery, fast = _discovery(), Backend("hosted_vllm/m", api_base="http://fast/v1", window=1024)
    discovery.correct(fast, 2048)
    info = discovery.window(fast)
    assert (info.window, info.source) == (1024, "declared")


def test_the_same_correction_again_is_not_warned_about_again():
    """A repeat of the same stated window is no news: one window_stale event, not one per overflow."""
    discovery, fast = _discovery(), Backend("hosted_vllm/m", api_base="http://fast/v1", window=99999)
    with capture_events() as events:
        discovery.correct(fast, 2048)
        discovery.correct(fast, 2048)
    assert [e["event"] for e in events].count("window_stale") == 1


def test_a_correction_of_a_declared_window_lasts_the_discovery_ttl():
    """The learned window stands for the TTL, after which the declared one is tried again."""
    clock = FakeClock()
    discovery, fast = _discovery(clock), Backend("hosted_vllm/m", api_base="http://fast/v1", window=99999)
    discovery.correct(fast, 2048)
    clock.advance(899.0)
    assert discovery.window(fast).window == 2048
    clock.advance(2.0)
    assert discovery.window(fast).window == 99999
