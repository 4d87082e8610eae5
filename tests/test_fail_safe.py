"""Fail safe under faults and hostile input: one regression test per finding of the reliability review."""

import asyncio
import threading

import pytest

from raw_server import RawServer, closed_port

from agentkv import (
    Backend, ConfigurationError, ContextOverflowError, RetryPolicy, Session, WarmAheadPolicy, WindowDiscovery,
)
from agentkv.http.transport import HttpError
from agentkv.retry import is_outage, outage_cause
from agentkv.testing import FakeClock, FakeHttp, capture_events, models_answer
from agentkv.warm import CooldownMap, InFlightLimit

FAST, SLOW = "http://127.0.0.1:9201/v1", "http://127.0.0.1:9202/v1"
HI = [{"role": "user", "content": "hi"}]


def backends(fast_window=None, slow_window=None):
    return (Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=fast_window),
            Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", window=slow_window))


class Answers:
    """A completion client answering with vLLM-style usage; ``down`` maps an api_base to the error it raises."""

    def __init__(self, down=None):
        self.down = dict(down or {})
        self.sent = []

    def _answer(self, kwargs):
        self.sent.append(kwargs)
        error = self.down.get(kwargs.get("api_base"))
        if error is not None:
            raise error
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        return self._answer(kwargs)


class Flaky:
    """A /v1/models server that fails while ``failing`` is set."""

    def __init__(self, window=4096, failing=True):
        self.window, self.failing, self.lock = window, failing, threading.Lock()

    def __call__(self, method, url, body):
        if self.failing:
            return 500, {"error": {"message": "Internal Server Error", "code": 500}}
        model = "fast-m" if url.startswith(FAST) else "slow-m"
        return models_answer(model, self.window)


def test_a_failed_models_fetch_is_retried_after_a_short_back_off_not_the_ttl():
    """Finding 1: one 500 at start-up is forgotten seconds later, not after the 15-minute TTL."""
    clock, server = FakeClock(), Flaky()
    discovery = WindowDiscovery(timer=clock, http=FakeHttp(server), retry_s=2.0)
    fast, _ = backends()
    assert discovery.window(fast).window is None
    server.failing = False
    assert discovery.window(fast).window is None  # still backing off
    clock.advance(2.1)
    assert discovery.window(fast).window == 4096 and discovery.served_model_known(fast)


def test_failures_back_off_and_warn_once_per_episode():
    """Finding 1: a failing server is asked at a doubling interval, and warned about once, not per request."""
    clock, server = FakeClock(), Flaky()
    http = FakeHttp(server)
    discovery = WindowDiscovery(timer=clock, http=http, retry_s=1.0, max_retry_s=8.0)
    fast, _ = backends()
    with capture_events() as events:
        for _ in range(40):
            discovery.window(fast)
            clock.advance(0.5)
    assert len(http.calls) == 5  # at t = 0, 1, 3, 7, 15 (the 8 s cap from there on): 20 s, 40 requests
    warnings = [e for e in events if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["discovery_failed", "window_fallback"]


def test_a_failure_never_replaces_a_success():
    """Finding 2: after a success, a later failure keeps the last good window instead of None."""
    clock, server = FakeClock(), Flaky(failing=False)
    discovery = WindowDiscovery(ttl_s=10.0, timer=clock, http=FakeHttp(server))
    fast, _ = backends()
    assert discovery.window(fast).window == 4096
    server.failing = True
    clock.advance(11.0)  # the success expired; the refetch fails
    assert discovery.window(fast).window == 4096


async def test_fifty_cold_async_sessions_send_one_models_request():
    """Finding 2: discovery is single-flight: 50 concurrent cold lookups share one GET /v1/models."""
    http = FakeHttp(Flaky(failing=False), latency_s=0.05)
    discovery = WindowDiscovery(http=http)
    fast, _ = backends()
    infos = await asyncio.gather(*(discovery.awindow(fast) for _ in range(50)))
    assert {i.window for i in infos} == {4096} and len(http.calls) == 1


def test_sync_threads_share_one_flight_too():
    """Finding 2: eight threads asking at once send one GET /v1/models."""
    http = FakeHttp(Flaky(failing=False), latency_s=0.05)
    discovery = WindowDiscovery(http=http)
    fast, _ = backends()
    threads = [threading.Thread(target=discovery.window, args=(fast,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(http.calls) == 1


@pytest.mark.parametrize("bad", [0, -5, "4096", True, 1.5])
def test_a_non_positive_or_non_integer_window_is_unknown(bad):
    """Finding 3: max_model_len <= 0 (or not an int) from a server is unknown, never trusted."""
    http = FakeHttp(lambda method, url, body: models_answer("slow-m" if url.startswith(SLOW) else "fast-m", bad))
    fast, slow = backends(fast_window=2048)
    s = Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, client=Answers(), count_with_server=False)
    big = [{"role": "user", "content": "word " * 3000}]
    s.completion(messages=big, max_tokens=8)  # slow's window is unknown: sent there, not refused
    assert s.last_route.role == "slow" and s.last_route.window is None


def test_the_escalated_turn_does_not_wait_for_the_warm_prefix_diagnostic():
    """Finding 5: the broken-warm check's /tokenize calls run after the escalated turn has returned."""
    gate, asked = threading.Event(), threading.Event()

    def server(method, url, body):
        if url.endswith("/models"):
            return models_answer("slow-m" if url.startswith(SLOW) else "fast-m", 2048 if url.startswith(FAST) else 16384)
        if url.startswith("http://127.0.0.1:9202"):  # the slow server's /tokenize hangs until released
            asked.set()
            gate.wait(10)
        count = 10 + sum(len(str(m["content"]).split()) for m in body["messages"])
        return {"count": count, "max_model_len": 16384, "tokens": list(range(count))}

    http = FakeHttp(server)
    fast, slow = backends()
    s = Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, client=Answers(),
                cooldowns=CooldownMap(), in_flight=InFlightLimit(4))
    s.completion(messages=[{"role": "user", "content": "word " * 1300}], max_tokens=8)  # ~65%: warms
    s.completion(messages=[{"role": "user", "content": "word " * 2100}], max_tokens=8)  # escalates
    returned_before_release = not gate.is_set()
    assert asked.wait(5) and returned_before_release and s.last_route.role == "slow"
    gate.set()
    assert s.drain_warms(10) and s.stats()["escalations_after_warm"] == 1


def test_a_tenant_without_a_salt_secret_is_refused(monkeypatch):
    """Finding 7: a tenant on a self-hosted backend with no secret fails closed, naming the variable."""
    monkeypatch.delenv("AGENTKV_CACHE_SALT_SECRET", raising=False)
    with pytest.raises(ConfigurationError, match="AGENTKV_CACHE_SALT_SECRET"):
        Session(*backends(), tenant="acme")
    assert Session(*backends(), tenant="acme", cache_salt=False)._parts.cache_salt is None  # the explicit opt-out
    assert Session(*backends())._parts.cache_salt is None  # no tenant: nothing to isolate
    monkeypatch.setenv("AGENTKV_CACHE_SALT_SECRET", "s3cret")
    assert Session(*backends(), tenant="acme")._parts.cache_salt


@pytest.mark.parametrize("keyed", [False, True], ids=["raw-warm", "litellm-warm"])
def test_a_failed_warm_logs_no_server_text(keyed):
    """Finding 8: warm_failed carries the error type and status, never the server's error text (raw POST warms
    and litellm warms alike)."""
    secret = "PROMPT-TEXT-ECHOED-BY-THE-SERVER"

    class Echo(Exception):
        status_code = 500

    def server(method, url, body):
        if url.endswith("/chat/completions"):  # the raw warm's POST: a 500 echoing the prompt
            return 500, {"error": {"message": secret, "type": "InternalServerError", "code": 500}}
        return models_answer("slow-m" if url.startswith(SLOW) else "fast-m", 2048 if url.startswith(FAST) else 16384)

    http = FakeHttp(server)
    fast, slow = backends()
    if keyed:  # a keyed backend warms through the completion client
        slow = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", api_key="k")
    client = Answers(down={SLOW: Echo(secret)})
    s = Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, client=client, count_with_server=False,
                cooldowns=CooldownMap(), in_flight=InFlightLimit(4))
    with capture_events() as events:
        s.completion(messages=[{"role": "user", "content": "word " * 1300}], max_tokens=8)
        assert s.drain_warms(10)
    failed = [e for e in events if e["event"] == "warm_failed"]
    assert failed and failed[0]["error"] == ("Echo" if keyed else "HttpError") and failed[0]["status_code"] == 500
    assert secret not in repr(events)


@pytest.mark.parametrize("budget", [{"max_tokens": 0}, {"max_tokens": -1}, {"max_completion_tokens": "10"},
                                    {"max_tokens": True}, {"max_tokens": 8, "max_completion_tokens": 0}])
def test_a_bad_budget_is_refused_before_any_network_call(budget):
    """Finding 11: an invalid max_tokens/max_completion_tokens raises before /models or /tokenize."""
    http = FakeHttp(lambda m, u, b: pytest.fail("no network call expected"))
    client = Answers()
    s = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=client)
    with pytest.raises(ValueError, match="max_"):
        s.completion(messages=HI, **budget)
    assert http.calls == [] and client.sent == []


class ConnectError(Exception):
    """Named like httpx's and litellm's connection errors."""


def discovered(http_windows=(2048, 16384)):
    return FakeHttp(lambda m, u, b: models_answer("slow-m" if u.startswith(SLOW) else "fast-m",
                                                  http_windows[0] if u.startswith(FAST) else http_windows[1]))


def test_a_fast_outage_fails_over_to_slow():
    """Finding 12: fast refusing connections hands a fitting turn to slow, counted and logged."""
    http = discovered()
    client = Answers(down={FAST: ConnectError("connection refused")})
    s = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=client, count_with_server=False,
                retry=_no_retry())
    with capture_events() as events:
        resp = s.completion(messages=HI, max_tokens=8)
    assert resp["choices"] and s.last_route.role == "slow" and s.last_route.reason == "failover"
    assert s.stats()["failovers"] == 1 and any(e["event"] == "failover" for e in events)


async def test_a_slow_outage_fails_over_to_fast_when_the_request_fits():
    """Finding 12: a 503 from slow sends a request that fits fast (clamped if need be) to fast."""

    class Unavailable(Exception):
        status_code = 503

    http = discovered()
    client = Answers(down={SLOW: Unavailable("busy")})
    # an exact count of 1,900 tokens: 1,900 + the 256 floor overflows fast, so it goes to slow; slow is down, and
    # fast still holds 1,900 + 100
    exact = FakeHttp(lambda m, u, b: {"count": 1900, "max_model_len": 2048, "tokens": list(range(1900))}
                     if u.endswith("/tokenize") else http.handler(m, u, b))
    s = Session(*backends(), discovery=WindowDiscovery(http=exact), http=exact, client=client, retry=_no_retry(),
                count_exactly=True)
    await s.acompletion(messages=[{"role": "user", "content": "a long tool result"}], max_tokens=100)
    assert s.last_route.role == "fast" and s.last_route.reason == "failover" and s.last_route.max_tokens == 100
    assert [c["api_base"] for c in client.sent] == [SLOW, FAST]


def test_an_outage_with_nowhere_to_go_propagates():
    """Finding 12: a request that fits only the backend that is down raises the original error."""
    http = discovered()
    client = Answers(down={SLOW: ConnectError("refused")})
    s = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=client, count_with_server=False,
                retry=_no_retry())
    with pytest.raises(ConnectError):
        s.completion(messages=[{"role": "user", "content": "word " * 2500}], max_tokens=8)


def test_every_attempt_carries_a_default_timeout_the_caller_can_override():
    """Finding 12: a request timeout is set by default (per Session), and a call's timeout= wins."""
    http = discovered()
    client = Answers()
    s = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=client, count_with_server=False)
    s.completion(messages=HI, max_tokens=8)
    s.completion(messages=HI, max_tokens=8, timeout=5)
    short = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=client, count_with_server=False,
                    request_timeout_s=30)
    short.completion(messages=HI, max_tokens=8)
    assert [c["timeout"] for c in client.sent] == [600.0, 5, 30]


def test_a_give_up_names_every_backend_considered():
    """Finding 12: ContextOverflowError.windows names fast and slow, not only the last backend."""

    class Overflowing(Exception):
        status_code = 400

    message = ("This model's maximum context length is 16384 tokens. However, you requested 20000 tokens "
               "(19992 in the messages, 8 in the completion). Please reduce the length of the messages or completion.")
    http = discovered()
    client = Answers(down={SLOW: Overflowing(message)})
    s = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=client, count_with_server=False)
    with pytest.raises(ContextOverflowError) as caught:
        s.completion(messages=[{"role": "user", "content": "word " * 3000}], max_tokens=8)
    assert set(caught.value.windows) == {"fast", "slow"}


def test_async_tokenize_reuses_one_pooled_client():
    """Finding 12: async /tokenize calls share one pooled httpx.AsyncClient per event loop."""
    from agentkv.http.transport import HttpxTransport

    transport = HttpxTransport()

    async def two_calls():
        clients = []
        for _ in range(2):
            try:
                await transport.arequest("POST", "http://127.0.0.1:9/tokenize", json={}, timeout_s=0.2)
            except HttpError:
                pass
            clients.append(transport._async_client())
        return clients

    first, second = asyncio.run(two_calls())
    assert first is second


def _no_retry():
    from agentkv import RetryPolicy

    return RetryPolicy(attempts=1)


def test_a_response_without_prompt_token_details_is_unknown_not_zero():
    """vLLM without --enable-prompt-tokens-details: cached tokens are unknown (None, counted), not 0."""

    class Bare(Answers):
        def _answer(self, kwargs):
            response = super()._answer(kwargs)
            del response["usage"]["prompt_tokens_details"]
            return response

    http = discovered()
    s = Session(*backends(), discovery=WindowDiscovery(http=http), http=http, client=Bare(), count_with_server=False)
    s.completion(messages=HI, max_tokens=8)
    assert s.ledger[-1].cached_tokens is None
    assert s.stats()["cached_tokens_unknown"] == 1 and s.stats()["cached_tokens_total"] == 0


# ----------------------------------------------------------------------------- issue 21: outages under any name
# Each fault is made on a real socket (tests/raw_server.py) and reached through the client that names it.


FAULTS = {"refused": {"refused"}, "close": {"dropped"}, "reset": {"dropped"}, "partial": {"dropped", "incomplete"}}
CHAT = {"model": "m", "messages": HI, "max_tokens": 4}


def _fault_url(fault):
    if fault == "refused":
        return f"http://127.0.0.1:{closed_port()}", None
    server = RawServer(fault)
    return server.url, server


def _raise_through(client, base):
    """Send one chat completion to ``base`` through ``client`` and return what it raised."""
    import httpx
    import litellm
    import openai

    async def run_async():
        if client == "litellm-async":
            await litellm.acompletion(model="hosted_vllm/m", api_base=base + "/v1", messages=HI, max_tokens=4,
                                      num_retries=0, max_retries=0)
        elif client == "openai-async":
            await openai.AsyncOpenAI(base_url=base + "/v1", api_key="-", max_retries=0).chat.completions.create(**CHAT)
        else:
            async with httpx.AsyncClient() as http:
                (await http.post(base + "/v1/chat/completions", json=CHAT)).raise_for_status()

    try:
        if client == "litellm":
            litellm.completion(model="hosted_vllm/m", api_base=base + "/v1", messages=HI, max_tokens=4,
                               num_retries=0, max_retries=0)
        elif client == "openai":
            openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0).chat.completions.create(**CHAT)
        elif client == "httpx":
            httpx.post(base + "/v1/chat/completions", json=CHAT).raise_for_status()
        else:
            asyncio.run(run_async())
    except Exception as error:  # noqa: BLE001 - the error is what the test inspects
        return error
    pytest.fail(f"{client} got an answer from a {base} that should have failed")


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("client", ["litellm", "litellm-async", "openai", "openai-async", "httpx", "httpx-async"])
def test_an_unreachable_backend_is_an_outage_whatever_the_client_calls_it(client, fault):
    """Refused, dropped, reset and half-answered connections are outages through litellm (InternalServerError 500),
    the OpenAI SDK (APIConnectionError) and raw httpx alike, decided from the cause under the wrapper."""
    base, server = _fault_url(fault)
    try:
        error = _raise_through(client, base)
    finally:
        if server is not None:
            server.close()
    assert is_outage(error), f"{type(error).__name__}: {error}"
    assert outage_cause(error) in FAULTS[fault]


def test_a_wrapper_name_alone_is_not_an_outage_and_a_broken_stream_never_is():
    """A 500 with no connection cause under it is not an outage; an error that delivered part of an answer never is,
    even with a dropped connection under it."""

    class InternalServerError(Exception):
        status_code = 500

    class Broken(Exception):
        partial_answer = True

    assert not is_outage(InternalServerError("boom"))
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except OSError as cause:
            raise Broken("stream broke") from cause
    except Broken as error:
        assert not is_outage(error) and outage_cause(error.__cause__) == "dropped"


def _no_sleep_policy(**kwargs):
    async def no_asleep(seconds):
        return None

    return RetryPolicy(sleep=lambda seconds: None, asleep=no_asleep, **kwargs)


def _real_session(fast_base, slow_base, *, fast_model="hosted_vllm/fast-m", **kwargs):
    fast = Backend(fast_model, api_base=fast_base + "/v1", name="fast", window=2048,
                   api_key="k" if fast_model.startswith("openai/") else None)
    slow = Backend("hosted_vllm/slow-m", api_base=slow_base + "/v1", name="slow", window=16384) if slow_base else None
    http = FakeHttp(lambda m, u, b: models_answer("fast-m" if u.startswith(fast_base) else "slow-m",
                                                  2048 if u.startswith(fast_base) else 16384))
    kwargs.setdefault("retry", _no_sleep_policy())
    return Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, count_with_server=False, **kwargs)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fast_backend_that_is_down_fails_over_to_slow_through_litellm(fault, asynchronous):
    """Through litellm's hosted_vllm provider, a fast backend refusing, dropping or half-answering the connection hands
    the turn to slow after its tries, and slow answers it."""
    base, server = _fault_url(fault)
    with RawServer("answer") as slow:
        s = _real_session(base, slow.url)
        try:
            if asynchronous:
                response = asyncio.run(s.acompletion(messages=HI, max_tokens=4))
            else:
                response = s.completion(messages=HI, max_tokens=4)
        finally:
            if server is not None:
                server.close()
    assert response.choices[0].message.content == "ok"
    assert s.last_route.role == "slow" and s.last_route.reason == "failover" and s.stats()["failovers"] == 1
    assert slow.chats == 1 and (server is None or server.chats == 3)


def test_a_read_timeout_fails_over_only_where_the_policy_says_so():
    """A backend that never answers: its read timeout fails over with RetryPolicy(timeout_fails_over=True) on a
    non-streamed request, and reaches the caller by default or on a streamed request."""
    import litellm

    with RawServer("silent") as fast, RawServer("answer") as slow:
        opted = _real_session(fast.url, slow.url, request_timeout_s=0.3,
                              retry=_no_sleep_policy(attempts=1, timeout_fails_over=True))
        assert opted.completion(messages=HI, max_tokens=4).choices[0].message.content == "ok"
        assert opted.last_route.reason == "failover" and slow.chats == 1
        default = _real_session(fast.url, slow.url, request_timeout_s=0.3, retry=_no_sleep_policy(attempts=1))
        with pytest.raises(litellm.Timeout):
            default.completion(messages=HI, max_tokens=4)
        with pytest.raises(litellm.Timeout):
            opted.completion(messages=HI, max_tokens=4, stream=True)
        assert slow.chats == 1 and fast.chats == 3


# ----------------------------------------------------------------------------- issue 21: tries per backend per turn

class Scripted(Answers):
    """A completion client whose backends each raise a fixed error (or answer), counting what each was sent."""

    def sent_to(self, base):
        return sum(1 for kwargs in self.sent if kwargs.get("api_base") == base)


class Overflow400(Exception):
    status_code = 400


class Unavailable503(Exception):
    status_code = 503


TOO_LONG = ("This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
            "prompt. (parameter=input_tokens, value=2049)")


def _bounce_session(client, handler=None, **kwargs):
    warms = []

    def server(method, url, body):
        if url.endswith("/chat/completions"):  # a raw warm to the slow server, which is down
            warms.append(url)
            return 503, {"error": {"message": "Service Unavailable", "code": 503}}
        if url.endswith("/tokenize"):
            return handler(body)
        return models_answer("slow-m" if url.startswith(SLOW) else "fast-m", None)

    http = FakeHttp(server)
    fast = Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=8192)  # the real window is 2048
    slow = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", window=32768)
    s = Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, client=client, retry=_no_sleep_policy(),
                cooldowns=CooldownMap(), in_flight=InFlightLimit(4), count_with_server=handler is not None, **kwargs)
    return s, warms


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_turn_refused_as_too_long_never_fails_over_back_to_the_backend_that_refused_it(asynchronous):
    """Fast under-counts and refuses the turn as too long, the escalation finds slow down: the turn is not failed over
    back to fast for a second refusal and a second escalation; slow gets its 3 tries plus the warm, no more."""
    client = Scripted(down={FAST: Overflow400(TOO_LONG), SLOW: Unavailable503("Service Unavailable")})
    s, warms = _bounce_session(client)
    messages = [{"role": "user", "content": "word " * 5000}]  # ~61% of the declared 8192: a warm fires

    async def turn():
        try:
            await s.acompletion(messages=messages, max_tokens=8)
        finally:
            await s.adrain_warms(10)

    with pytest.raises(Unavailable503):
        if asynchronous:
            asyncio.run(turn())
        else:
            s.completion(messages=messages, max_tokens=8)
    assert s.drain_warms(10)
    assert client.sent_to(SLOW) + len(warms) == 4 and client.sent_to(SLOW) == 3 and client.sent_to(FAST) == 1
    assert s.stats()["failovers"] == 0


def test_a_failover_that_is_refused_as_too_long_never_escalates_back_to_the_backend_that_was_down():
    """Slow is down, the turn fails over to fast, fast refuses it as too long: the turn ends with a
    ContextOverflowError naming slow as down, and slow is not sent the payload again."""
    client = Scripted(down={FAST: Overflow400(TOO_LONG), SLOW: Unavailable503("Service Unavailable")})
    exact = {"count": 8000, "max_model_len": 8192, "tokens": list(range(8000))}
    s, _ = _bounce_session(client, handler=lambda body: exact, count_exactly=True, warm_ahead=WarmAheadPolicy(
        enabled=False))
    with pytest.raises(ContextOverflowError, match="'slow' is down this turn"):
        s.completion(messages=[{"role": "user", "content": "a long tool result"}], max_tokens=8)
    assert client.sent_to(SLOW) == 3 and client.sent_to(FAST) == 1 and s.stats()["failovers"] == 1


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", ["openai-provider", "num_retries-kwarg"])
def test_litellms_own_retries_never_multiply_the_policys(case, asynchronous):
    """Through litellm, a failing backend gets RetryPolicy.attempts requests for a turn: litellm's num_retries (a
    caller's kwarg) and the OpenAI SDK client it builds for openai/ models (max_retries 2) are turned off."""
    extra = {"num_retries": 2} if case == "num_retries-kwarg" else {}
    model = "openai/fast-m" if case == "openai-provider" else "hosted_vllm/fast-m"
    with RawServer("503") as fast:
        s = _real_session(fast.url, None, fast_model=model)
        with pytest.raises(Exception) as caught:
            if asynchronous:
                asyncio.run(s.acompletion(messages=HI, max_tokens=4, **extra))
            else:
                s.completion(messages=HI, max_tokens=4, **extra)
    assert getattr(caught.value, "status_code", None) == 503 and fast.chats == 3


def test_a_users_client_is_told_not_to_retry():
    """A user's completion client that retries unless told max_retries=0 (as litellm's OpenAI clients do) sends the
    policy's 3 tries, not 3 times its own."""

    class RetryingClient:
        def __init__(self):
            self.requests = 0

        def completion(self, **kwargs):
            for _ in range(1 + kwargs.get("max_retries", 2)):
                self.requests += 1
            raise Unavailable503("Service Unavailable")

    client = RetryingClient()
    s = Session(Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=2048), client=client,
                retry=_no_sleep_policy(), discovery=WindowDiscovery(http=discovered()), http=discovered(),
                count_with_server=False)
    with pytest.raises(Unavailable503):
        s.completion(messages=HI, max_tokens=4)
    assert client.requests == 3


# ----------------------------------------------------------------------------- issue 21: the OpenAI SDK's transport

def _sdk(s, fast, *, asynchronous, max_retries=5):
    """An OpenAI SDK client over agentkv's transport, with more retries of its own than the policy allows."""
    import httpx
    import openai

    from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport

    if asynchronous:
        return openai.AsyncOpenAI(base_url=fast + "/v1", api_key="-", max_retries=max_retries,
                                  http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(s)))
    return openai.OpenAI(base_url=fast + "/v1", api_key="-", max_retries=max_retries,
                         http_client=httpx.Client(transport=AgentKVTransport(s)))


def _create(client, asynchronous, **extra):
    """One chat completion (a stream's chunks collected), the async client run on a loop of its own."""
    async def run():
        answer = await client.chat.completions.create(model="fast-m", messages=HI, max_tokens=4, **extra)
        return [chunk async for chunk in answer] if extra.get("stream") else answer

    if asynchronous:
        return asyncio.run(run())
    answer = client.chat.completions.create(model="fast-m", messages=HI, max_tokens=4, **extra)
    return list(answer) if extra.get("stream") else answer


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_openai_sdk_under_the_transport_fails_over_a_fast_backend_that_is_down(fault, asynchronous):
    """Under AgentKVTransport, a fast backend refusing, dropping or half-answering the connection hands the turn to
    slow after the policy's 3 tries, however many retries the SDK has of its own."""
    base, server = _fault_url(fault)
    with RawServer("answer") as slow:
        s = _real_session(base, slow.url)
        try:
            answer = _create(_sdk(s, base, asynchronous=asynchronous), asynchronous)
        finally:
            if server is not None:
                server.close()
    assert answer.choices[0].message.content == "ok" and s.last_route.reason == "failover"
    assert slow.chats == 1 and (server is None or server.chats == 3)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_sdks_own_retries_never_multiply_the_transports(asynchronous):
    """Both backends answer 503: each gets the policy's 3 tries and the SDK (max_retries=5) none of its own; both
    unreachable: the same, and the caller gets the SDK's own APIConnectionError."""
    import openai

    with RawServer("503") as fast, RawServer("503") as slow:
        s = _real_session(fast.url, slow.url)
        with pytest.raises(openai.InternalServerError):
            _create(_sdk(s, fast.url, asynchronous=asynchronous), asynchronous)
    assert (fast.chats, slow.chats) == (3, 3)
    refused = f"http://127.0.0.1:{closed_port()}"
    with RawServer("close") as slow:
        s = _real_session(refused, slow.url)
        with pytest.raises(openai.APIConnectionError):
            _create(_sdk(s, refused, asynchronous=asynchronous), asynchronous)
    assert slow.chats == 3


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_stream_broken_after_its_first_bytes_is_not_resent(asynchronous):
    """A stream that breaks after its first event raises StreamBrokenError to the caller, who holds a partial answer;
    nothing is re-sent, to fast or to slow."""
    from agentkv.integrations.openai import StreamBrokenError

    with RawServer("stream_cut") as fast, RawServer("answer") as slow:
        s = _real_session(fast.url, slow.url)
        with pytest.raises(StreamBrokenError, match="never re-sends a stream"):
            _create(_sdk(s, fast.url, asynchronous=asynchronous), asynchronous, stream=True)
    assert (fast.chats, slow.chats) == (1, 0)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_stream_that_breaks_before_its_first_bytes_fails_over(asynchronous):
    """A stream whose connection closes before its first event has given the caller nothing: it is retried and failed
    over like any outage, and slow's stream reaches the caller whole."""
    with RawServer("stream_empty") as fast, RawServer("answer") as slow:
        s = _real_session(fast.url, slow.url)
        chunks = _create(_sdk(s, fast.url, asynchronous=asynchronous), asynchronous, stream=True,
                         stream_options={"include_usage": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    assert (fast.chats, slow.chats) == (3, 1) and s.last_route.reason == "failover"
    assert s.ledger[-1].cached_tokens == 0  # the usage chunk was read on the way


def test_the_usage_watch_holds_a_bounded_line_in_linear_time():
    """32 MiB of one SSE line without a newline is dropped as it grows (under 2 MiB held at the peak, not 32), and the
    usage line after it is still read."""
    import tracemalloc

    from agentkv.wire.openai import UsageWatch

    watch, piece = UsageWatch(), b"x" * 65536
    tracemalloc.start()
    try:
        for _ in range(512):
            watch.feed(piece)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    watch.feed(b'\ndata: {"choices": [], "usage": {"prompt_tokens": 3}}\n')
    assert peak < 2 * 2**20 and watch.usage_chunk["usage"] == {"prompt_tokens": 3}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_raw_httpx_client_over_the_transport_fails_over_too(fault, asynchronous):
    """A plain httpx client over AgentKVTransport (no SDK): an unreachable fast is failed over to slow, whose answer
    comes back as it came; with slow down too, httpx's own error reaches the caller, not an SDK's."""
    import httpx

    from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport

    def post(s, base):
        url = base + "/v1/chat/completions"
        if asynchronous:
            async def run():
                async with httpx.AsyncClient(transport=AsyncAgentKVTransport(s)) as client:
                    return await client.post(url, json=CHAT)
            return asyncio.run(run())
        with httpx.Client(transport=AgentKVTransport(s)) as client:
            return client.post(url, json=CHAT)

    base, server = _fault_url(fault)
    try:
        with RawServer("answer") as slow:
            answer = post(_real_session(base, slow.url), base)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ok"
        with RawServer("reset") as slow, pytest.raises(httpx.TransportError):
            post(_real_session(base, slow.url), base)
    finally:
        if server is not None:
            server.close()
