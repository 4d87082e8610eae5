"""Fail safe, secrets and telemetry (issue 37): no URL agentkv shows carries a query string's values, a warm carries
only the headers it is allowed to, tenant digests are keyed by the salt secret, telemetry never fails a turn, and a
header agentkv cannot send is refused once, before anything is sent."""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import Sampler  # noqa: E402

import agentkv.telemetry  # noqa: E402
from agentkv import Backend, ConfigurationError, Session, WindowDiscovery  # noqa: E402
from agentkv.http.transport import redact_url  # noqa: E402
from agentkv.demo.script import TOOLS, ScriptedAgent  # noqa: E402
from agentkv.fleet import ranked, routing_key  # noqa: E402
from agentkv.state import InProcessStore  # noqa: E402
from agentkv.testing import capture_events  # noqa: E402

TOOLS8 = TOOLS[:8]
SECRET_URL = "http://u:pw@127.0.0.1:9/v1?api_key=SECRET&token=T2#frag"
LEAKS = ("SECRET", "T2", "pw", "frag")
CREDENTIAL_HEADERS = {"X-Goog-IAP-JWT-Assertion": "jwt-1", "X-Amzn-Oidc-Data": "oidc-1", "X-Jwt-Assertion": "jwt-2",
                      "X-Forwarded-Client-Cert": "cert-1", "X-Passcode": "1234", "X-Otp": "999111",
                      "X-Hmac": "hmac-1", "X-Sig": "sig-1", "Bearer": "sk-bearer"}


def grow(turns, seed=0):
    return ScriptedAgent(result_rows=1).conversation(turns, tag=f" (conversation {seed})")


@pytest.fixture
def otel():
    """agentkv's spans into an in-memory exporter for one test."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    agentkv.telemetry.use(tracer_provider=provider)
    try:
        yield spans
    finally:
        agentkv.telemetry.use()


def backends(fresh, **slow_kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow", **slow_kwargs)
    return fast, slow


def session(fresh, *, slow=None, **kwargs):
    fast, plain = backends(fresh)
    return Session(fast, slow or plain, session_id=fresh["session_id"], discovery=fresh["discovery"],
                   state=InProcessStore(cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"]), **kwargs)


def to_slow(s, history, **kwargs):
    for msgs in history:
        s.completion(messages=msgs, tools=TOOLS8, max_tokens=2, **kwargs)
        s.drain_warms(30)
        if s.last_route.role == "slow":
            return
    raise AssertionError("the conversation never escalated")


def warms(server):
    return [r for r in server.requests if r.path == "/v1/chat/completions" and r.body.get("max_tokens") == 1]


# ----------------------------------------------------------------------------- query strings (finding 5)

def test_redact_url_drops_credentials_query_and_fragment():
    """A shown URL keeps scheme, host, port and path: no user:password@, no query string, no fragment."""
    assert redact_url(SECRET_URL) == "http://127.0.0.1:9/v1"
    assert redact_url("http://h:1/v1/models?x=a@b") == "http://h:1/v1/models"
    assert redact_url("https://h/v1#k=v") == "https://h/v1"
    pool = Backend("hosted_vllm/m", api_base=[SECRET_URL, "http://127.0.0.1:8/v1?api_key=SECRET"])
    shown = [repr(pool), pool.replica(SECRET_URL).replica_name]
    with pytest.raises(ConfigurationError) as twice:
        Backend("hosted_vllm/m", api_base=[SECRET_URL, SECRET_URL])
    with pytest.raises(ConfigurationError) as bad:
        Backend("hosted_vllm/m", api_base="ftp://u:pw@h/v1?api_key=SECRET")
    for text in (*shown, str(twice.value), str(bad.value)):
        assert not any(leak in text for leak in LEAKS), text


def test_a_replica_failover_shows_no_query_string_in_events_stats_or_spans(fresh, otel):
    """A conversation homed on a dead replica whose URL carries ?api_key=: its replica_ejected and replica_failover
    events, the Session's stats and the agentkv.replica span attribute show the replica without the query."""
    live = fresh["fast"].api_base
    secret = "salt-secret"
    sid = next(f"q{i}" for i in range(1000) if ranked(routing_key(None, f"q{i}", secret), [SECRET_URL, live])[0]
               == SECRET_URL)
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=[SECRET_URL, live], name="fast")
    _, slow = backends(fresh)
    with capture_events() as events, Session(fast, slow, session_id=sid, discovery=WindowDiscovery(),
                                             state=InProcessStore(), cache_salt_secret=secret) as s:
        assert s.completion(messages=grow(1)[0], max_tokens=2).choices
        stats = json.dumps(s.stats(), default=str)
    names = {e["event"] for e in events}
    assert {"replica_ejected", "replica_failover"} <= names, names
    shown = json.dumps(events, default=str) + stats
    spans = otel.get_finished_spans()
    replicas = [sp.attributes["agentkv.replica"] for sp in spans if "agentkv.replica" in sp.attributes]
    assert "http://127.0.0.1:9/v1" in replicas, replicas
    shown += json.dumps([dict(sp.attributes) for sp in spans], default=str)
    assert not any(leak in shown for leak in LEAKS)


# ----------------------------------------------------------------------------- warm headers (finding 6)

def test_credential_headers_never_reach_the_slow_replica_on_a_warm(fresh):
    """Each credential header the old deny-list missed, sent with the turn that fires a warm, never reaches the slow
    replica on the warm; the caller's own session header (an affinity header) does."""
    with session(fresh) as s:
        to_slow(s, grow(12), extra_headers={**CREDENTIAL_HEADERS, "X-Session-ID": "caller-7"})
    warm = warms(fresh["slow"])
    assert len(warm) == 1
    sent = warm[0].headers
    assert sent.get("x-session-id") == "caller-7"
    assert not {name.lower() for name in CREDENTIAL_HEADERS} & set(sent), sorted(sent)


def test_a_warm_carries_the_headers_its_backend_names_and_nothing_else(fresh):
    """A header named in the slow backend's forward_headers (in any case) rides on the warm; X-Team, not named, does
    not."""
    _, slow = backends(fresh, forward_headers=("x-route-hint",))
    with session(fresh, slow=slow) as s:
        to_slow(s, grow(12), extra_headers={**CREDENTIAL_HEADERS, "X-Route-Hint": "hint-1", "X-Team": "search"})
    sent = warms(fresh["slow"])[0].headers
    assert sent.get("x-route-hint") == "hint-1" and sent.get("x-session-id") == s.routing_key
    assert not ({name.lower() for name in CREDENTIAL_HEADERS} | {"x-team"}) & set(sent), sorted(sent)


def test_a_warm_prepared_from_a_raw_request_carries_only_allowed_headers(fresh):
    """Session.prepare(body, headers=...) (the OpenAI-SDK transport's path) follows the same allow-list; without a
    configured name a warm carries the routing key alone."""
    with session(fresh) as s:
        for msgs in grow(12):
            attempt = s.prepare({"model": "fast-tiny", "messages": msgs, "tools": TOOLS8, "max_tokens": 2},
                                headers={**CREDENTIAL_HEADERS, "X-Team": "search"})
            s.drain_warms(30)
            if s.stats()["warm_fired"]:
                break
        assert attempt.decision is not None
    sent = warms(fresh["slow"])[0].headers
    assert sent.get("x-session-id") == s.routing_key
    assert not ({name.lower() for name in CREDENTIAL_HEADERS} | {"x-team"}) & set(sent), sorted(sent)


def test_a_litellm_warm_carries_only_allowed_headers():
    """A warm sent through litellm (a slow backend with a key) builds its extra_headers from the same allow-list."""
    from agentkv._session.attempts import warm_kwargs

    slow = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", api_key="sk-slow", forward_headers=("X-Route-Hint",))
    call = warm_kwargs(slow, {"messages": [{"role": "user", "content": "hi"}],
                              "extra_headers": {**CREDENTIAL_HEADERS, "x-route-hint": "h", "X-Team": "t"}},
                       None, 5.0, routing_key="k" * 32)
    assert call["extra_headers"] == {"x-route-hint": "h", "X-Session-ID": "k" * 32}


def test_forward_headers_are_checked_names():
    """Backend.forward_headers holds header names only: a tuple, no CR/LF, no headers a warm sets itself, bounded."""
    assert Backend("hosted_vllm/m", forward_headers=["X-A", "x-b"]).forward_headers == ("X-A", "x-b")
    for bad in ("X-A", ("X-A\r\nX-B: 1",), ("X-Ä",), ("Content-Length",), ("Host",), ("x-a", "X-A"),
                tuple(f"X-H{i}" for i in range(33)), (7,)):
        with pytest.raises(ConfigurationError, match="forward_headers"):
            Backend("hosted_vllm/m", forward_headers=bad)


# ----------------------------------------------------------------------------- tenant digests (finding 7)

def test_the_tenant_digest_in_spans_is_keyed_by_the_salt_secret(fresh, otel):
    """With a secret, none of five candidate names' unkeyed SHA-256 matches the span's agentkv.tenant; without one
    the digest is the plain SHA-256 prefix."""
    candidates = ["acme", "globex", "initech", "umbrella", "hooli"]
    with session(fresh, tenant="globex", cache_salt_secret="salt-secret") as s:
        s.completion(messages=grow(1)[0], max_tokens=2)
    shown = {sp.attributes.get("agentkv.tenant") for sp in otel.get_finished_spans()} - {None}
    assert len(shown) == 1
    unkeyed = {hashlib.sha256(name.encode()).hexdigest()[:16] for name in candidates}
    assert not shown & unkeyed
    assert shown == {agentkv.telemetry.tenant_digest("globex", "salt-secret")}
    assert agentkv.telemetry.tenant_digest("globex") == hashlib.sha256(b"globex").hexdigest()[:16]
    assert agentkv.telemetry.tenant_digest("globex", "other") not in shown


# ----------------------------------------------------------------------------- telemetry never fails a turn (12)

class RaisingSampler(Sampler):
    def should_sample(self, *args, **kwargs):
        raise RuntimeError("sampler down: prompt text here")

    def get_description(self):
        return "RaisingSampler"


class RaisingProcessor(SpanProcessor):
    def __init__(self, where):
        self.where = where

    def on_start(self, span, parent_context=None):
        if self.where == "on_start":
            raise RuntimeError("processor down: prompt text here")

    def on_end(self, span):
        if self.where == "on_end":
            raise RuntimeError("processor down: prompt text here")


class RaisingInstrument:
    def add(self, *args, **kwargs):
        raise RuntimeError("meter down")

    record = add


class RaisingMeterProvider:
    def get_meter(self, *args, **kwargs):
        return self

    def create_histogram(self, *args, **kwargs):
        return RaisingInstrument()

    create_counter = create_histogram


def broken_provider(kind):
    if kind == "sampler":
        return TracerProvider(sampler=RaisingSampler())
    provider = TracerProvider()
    provider.add_span_processor(RaisingProcessor(kind))
    return provider


@pytest.fixture(params=["sampler", "on_start", "on_end"])
def broken(request):
    agentkv.telemetry.use(tracer_provider=broken_provider(request.param), meter_provider=RaisingMeterProvider())
    try:
        yield request.param
    finally:
        agentkv.telemetry.use()


def check_reported_once(events):
    failed = [e for e in events if e["event"] == "telemetry_failed"]
    assert len(failed) == 1, failed  # once, however many spans and metrics were lost
    assert failed[0]["error"] == "RuntimeError" and "prompt" not in json.dumps(failed, default=str)
    assert agentkv.telemetry.failures()["RuntimeError"] > 1


def test_a_raising_sampler_processor_or_meter_loses_the_span_never_the_turn(fresh, broken):
    """Sync: every turn of a conversation that warms and escalates is answered; the failure is reported once."""
    with capture_events() as events, session(fresh) as s:
        to_slow(s, grow(12))
    assert s.stats()["warm_fired"] == 1 and s.ledger[-1].backend == "slow"
    check_reported_once(events)


@pytest.mark.asyncio
async def test_a_raising_sampler_processor_or_meter_loses_the_span_never_the_async_turn(fresh, broken):
    """Async: the same conversation through acompletion."""
    with capture_events() as events:
        async with session(fresh) as s:
            for msgs in grow(12):
                await s.acompletion(messages=msgs, tools=TOOLS8, max_tokens=2)
                await s.adrain_warms(30)
                if s.last_route.role == "slow":
                    break
    assert s.stats()["warm_fired"] == 1 and s.ledger[-1].backend == "slow"
    check_reported_once(events)


# ----------------------------------------------------------------------------- a header agentkv cannot send (minor)

@pytest.mark.parametrize("name, value", [("X-Bad", "a\r\nInjected: 1"), ("X-Bad", "caf\u00e9"),
                                         ("X-B\u00e4d", "plain"), ("X-Bad\r\nInjected", "value-9"), ("X-Bad", "nul\0")])
def test_a_header_agentkv_cannot_send_is_refused_once_before_any_request(fresh, name, value):
    """CR/LF, NUL or non-ASCII in a caller header's name or value: a ConfigurationError naming the header (never its
    value), raised before any network call, on completion, acompletion and prepare alike."""
    import asyncio

    with session(fresh) as s:
        calls = [lambda: s.completion(messages=grow(1)[0], max_tokens=2, extra_headers={name: value}),
                 lambda: s.completion(messages=grow(1)[0], max_tokens=2, headers={name: value}),
                 lambda: asyncio.run(s.acompletion(messages=grow(1)[0], max_tokens=2, extra_headers={name: value})),
                 lambda: s.prepare({"model": "m", "messages": grow(1)[0]}, headers={name: value})]
        for call in calls:
            with pytest.raises(ConfigurationError) as refused:
                call()
            assert "X-B" in str(refused.value) and "header" in str(refused.value)
            assert value not in str(refused.value)
    assert fresh["fast"].requests == [] and fresh["slow"].requests == []


def test_a_backends_own_headers_are_checked_when_it_is_built():
    """extra_headers in a Backend's completion_kwargs that cannot be sent are refused at construction."""
    with pytest.raises(ConfigurationError, match="X-Bad"):
        Backend("hosted_vllm/m", completion_kwargs={"extra_headers": {"X-Bad": "a\nb"}})
