"""agentkv.testing, the package users' tests import: cheap to import, its servers and provider fakes apart."""

import subprocess
import sys
import textwrap


def test_importing_agentkv_testing_loads_no_heavy_dependency_and_starts_nothing():
    """``import agentkv.testing`` (the HTTP fake, the clock, event capture, scripted replies) imports neither torch,
    redis nor litellm, nor its servers' and provider fakes' modules, and starts no thread."""
    code = textwrap.dedent('''
        import sys, threading
        import agentkv.testing
        from agentkv.testing import FakeClock, FakeHttp, ScriptedReplies, ScriptedTransport, capture_events
        heavy = ("torch", "redis", "litellm", "agentkv.testing.servers", "agentkv.testing.providers",
                 "agentkv.embedded")
        print([name for name in heavy if name in sys.modules], threading.active_count())
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split("\n")[0] == "[] 1"


def test_the_servers_and_the_provider_fakes_are_modules_of_their_own():
    """The fixtures that start binaries or load torch, and the hosted providers' fakes, are imported by name."""
    from agentkv.testing.providers import FakeAnthropic, FakeGemini, FakeOpenAI
    from agentkv.testing.servers import embedded_servers, free_port, redis_server

    assert callable(embedded_servers) and callable(redis_server) and 0 < free_port() < 65536
    assert {cls.__module__ for cls in (FakeAnthropic, FakeGemini, FakeOpenAI)} == {
        "agentkv.testing.providers.anthropic", "agentkv.testing.providers.gemini", "agentkv.testing.providers.openai"}


def test_the_fake_clock_moves_only_when_told():
    from agentkv.testing import FakeClock

    clock = FakeClock(start=5.0)
    assert clock() == clock() == 5.0
    clock.advance(300)
    assert clock() == 305.0
