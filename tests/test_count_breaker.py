"""Count sources back off: a hung or failing /tokenize is waited on once, then skipped until a probe succeeds."""

import pytest

from agentkv import Backend, Session
from agentkv.http.transport import HttpError
from agentkv.testing import FakeClock, FakeHttp
from agentkv.tokens import TokenCounter
from agentkv.tokens.breaker import CircuitBreaker, shared_breaker
from agentkv.tokens.sources import DEFAULT_TOKENIZE_TIMEOUT_S, ServerSource

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "How full is the disk?"}]


def tokenize_answer(method, url, body):
    return {"count": 42, "max_model_len": 2048, "tokens": list(range(42))}


def backend(port):
    return Backend("hosted_vllm/m", api_base=f"http://127.0.0.1:{port}/v1", name="fast", window=2048)


def hung_session(port, http, clock, asynchronous=False):
    """A Session whose fast counter asks a /tokenize that never answers within its timeout."""
    fast = backend(port)
    s = Session(fast, http=http, count_exactly=True)
    s._parts.counters["fast"] = TokenCounter.for_backend(fast, http=http, estimate_first=False, tokenize_timeout_s=0.05,
                                                  breaker=CircuitBreaker(backoff_s=30, clock=clock))
    return s


def tokenize_calls(http):
    return [c for c in http.calls if c.url.endswith("/tokenize")]


def test_a_hung_tokenize_is_waited_on_once_then_skipped_until_the_back_off_ends():
    """The first turn waits for the timeout; the second asks nothing; after the back-off one probe is sent."""
    clock, http = FakeClock(), FakeHttp(tokenize_answer, latency_s=1.0)
    with hung_session(1, http, clock) as s:
        first = s.observe(messages=MSGS)
        second = s.observe(messages=MSGS + [{"role": "user", "content": "And now?"}])
        assert len(tokenize_calls(http)) == 1
        assert first.count.source == second.count.source == "tiktoken"
        clock.advance(31)
        http.latency_s = 0.0  # the server is back
        third = s.observe(messages=MSGS + [{"role": "user", "content": "Now?"}])
        assert len(tokenize_calls(http)) == 2 and third.count.source == "server"
    assert [row.count_kind for row in s.ledger] == ["estimate", "estimate", "exact"]


async def test_the_async_twin_backs_off_the_same_way():
    """Under acompletion's counting path a hung /tokenize is awaited once, then skipped."""
    clock, http = FakeClock(), FakeHttp(tokenize_answer, latency_s=1.0)
    async with hung_session(2, http, clock) as s:
        await s.aobserve(messages=MSGS)
        await s.aobserve(messages=MSGS + [{"role": "user", "content": "And now?"}])
    assert len(tokenize_calls(http)) == 1 and not http.blocking_calls


def test_a_5xx_opens_the_breaker_and_a_4xx_does_not():
    """A 503 opens the breaker for the process's source at that URL; a 400 (this body refused) leaves it closed."""
    def failing(status):
        def handler(method, url, body):
            raise HttpError(f"{status}", status_code=status)
        return handler

    clock = FakeClock()
    refused = ServerSource(backend(3), http=FakeHttp(failing(400)), breaker=CircuitBreaker(clock=clock))
    counter = TokenCounter([refused, *TokenCounter.for_backend(backend(3), use_server=False).sources])
    for _ in range(2):
        counter.count(_payload())
    assert not refused.breaker.is_open and len(refused._http.calls) == 2
    down = ServerSource(backend(4), http=FakeHttp(failing(503)), breaker=CircuitBreaker(clock=clock))
    counter = TokenCounter([down, *TokenCounter.for_backend(backend(4), use_server=False).sources])
    assert [counter.count(_payload()).source for _ in range(2)] == ["tiktoken", "tiktoken"]
    assert down.breaker.is_open and len(down._http.calls) == 1


def test_back_off_doubles_while_probes_fail_and_one_probe_at_a_time():
    """After each failed probe the breaker stays open twice as long; only one caller probes."""
    clock = FakeClock()
    breaker = CircuitBreaker(backoff_s=10, max_backoff_s=25, clock=clock)
    breaker.failed()
    clock.advance(9.9)
    assert not breaker.allow()
    clock.advance(0.2)
    assert breaker.allow() and not breaker.allow()  # the probe, and no second one
    breaker.failed()
    clock.advance(19.9)
    assert not breaker.allow()
    clock.advance(0.2)
    assert breaker.allow()
    breaker.failed()
    clock.advance(25.1)  # capped at max_backoff_s
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.allow() and breaker.allow() and not breaker.is_open


def test_breakers_are_per_process_and_backend_and_the_default_timeout_is_short():
    """Two sources for one URL share a breaker; another URL has its own; /tokenize waits 2 s at most."""
    a, b, c = ServerSource(backend(5)), ServerSource(backend(5)), ServerSource(backend(6))
    assert a.breaker is b.breaker is shared_breaker("http://127.0.0.1:5/tokenize") and c.breaker is not a.breaker
    assert a._timeout_s == DEFAULT_TOKENIZE_TIMEOUT_S <= 2.0
    with pytest.raises(ValueError):
        CircuitBreaker(backoff_s=0)


def _payload():
    from agentkv.tokens import payload_from_request

    return payload_from_request({"messages": MSGS})
