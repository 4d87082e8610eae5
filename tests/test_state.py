"""The shared state store against a real redis-server: atomic claims, bounds, leases, windows, outages."""

import asyncio
import threading
import time
import uuid

import pytest

from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.state import InProcessStore, RedisStore, SharedWindow, StateUnavailable, WarmClaim
from agentkv.testing import FakeHttp, models_answer
from agentkv.testing.servers import redis_server

FAST, SLOW = "http://127.0.0.1:9201/v1", "http://127.0.0.1:9202/v1"
SECRET_WORD = "zanzibar-quokka"


def claim(session="s", tenant="t", *, limit=4, lease_s=30.0, cooldown_s=300.0, max_sessions=256):
    return WarmClaim(tenant, session, cooldown_s, max_sessions, limit, lease_s)


@pytest.fixture
def store(redis_url):
    """A RedisStore on its own namespace, so tests never see each other's keys."""
    s = RedisStore.from_url(redis_url, namespace=uuid.uuid4().hex, timeout_s=2.0)
    yield s
    s.close()


def keys_of(store):
    return sorted(store.client.scan_iter(f"{store.keys.prefix}:*"))


def test_one_claim_wins_among_threads_racing_for_one_session(store):
    """Sixteen threads claiming one (tenant, session) at once: exactly one fires, the rest see the cooldown."""
    outcomes, barrier = [], threading.Barrier(16)

    def race():
        barrier.wait()
        outcomes.append(store.claim(claim(limit=64))[0])

    threads = [threading.Thread(target=race) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["cooldown"] * 15 + ["fire"]


def test_each_tenants_map_is_bounded_and_evicts_the_oldest(store):
    """300 sessions of one tenant leave 256 entries (the oldest evicted); another tenant's map is apart."""
    for i in range(300):
        assert store.claim(claim(f"s{i}", limit=1000))[0] == "fire"
    store.claim(claim("other", tenant="u", limit=1000))
    assert store.client.zcard(store.keys.cooldowns("t")) == 256
    assert store.client.zcard(store.keys.cooldowns("u")) == 1
    assert store.claim(claim("s0", limit=1000))[0] == "fire"  # evicted: may warm again
    assert store.claim(claim("s299", limit=1000))[0] == "cooldown"


def test_the_in_flight_bound_holds_and_a_saturated_claim_starts_no_cooldown(store):
    """With 4 slots, the fifth session is saturated; after a release it fires (its cooldown was not taken)."""
    leases = [store.claim(claim(f"s{i}"))[1] for i in range(4)]
    assert all(leases) and store.claim(claim("s4")) == ("saturated", None)
    store.release(leases[0])
    outcome, lease = store.claim(claim("s4"))
    assert outcome == "fire" and lease is not None


def test_a_lease_nobody_releases_expires(store):
    """A holder that never releases (a dead replica) loses its slot after lease_s."""
    assert store.claim(claim("a", limit=1, lease_s=0.3))[0] == "fire"
    assert store.claim(claim("b", limit=1, lease_s=0.3))[0] == "saturated"
    deadline = time.monotonic() + 5.0
    while store.claim(claim("b", limit=1, lease_s=0.3))[0] != "fire":
        assert time.monotonic() < deadline, "the slot never came back"
        time.sleep(0.05)


def test_a_correction_one_replica_writes_is_read_by_another(store, redis_url):
    """Windows and corrections written through one store are read through another on the same namespace."""
    other = RedisStore.from_url(redis_url, namespace=store.namespace)
    store.write_window("k", SharedWindow(window=2048, model_listed=True), 60)
    store.write_window("k", SharedWindow(correction=1024), 60)
    assert other.read_window("k") == SharedWindow(2048, True, 1024)
    assert other.read_window("missing") == SharedWindow()
    store.write_window("short", SharedWindow(correction=512), 0.05)
    time.sleep(0.2)
    assert other.read_window("short") == SharedWindow()


def test_a_store_that_cannot_reach_redis_fails_fast_then_reconnects_by_itself(redis_url):
    """Nothing listening: StateUnavailable within the timeout, fast while backing off; a server appears: it works."""
    from agentkv.testing.servers import free_port

    port = free_port()
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", namespace="n", retry_s=0.2)
    for _ in range(3):
        with pytest.raises(StateUnavailable):
            store.claim(claim())
    with redis_server(port):
        deadline = time.monotonic() + 5.0
        while True:
            try:
                assert store.claim(claim())[0] == "fire"
                break
            except StateUnavailable:
                assert time.monotonic() < deadline, "the store never reconnected"
                time.sleep(0.05)
    store.close()


class Answers:
    """A completion client answering every request, and a fast model that overflows above ``fast_limit``."""

    def __init__(self, fast_limit=None):
        self.sent, self.fast_limit = [], fast_limit

    def _answer(self, kwargs):
        self.sent.append(kwargs)
        if self.fast_limit and kwargs["model"].endswith("fast-m") and kwargs.get("max_tokens") != 1:
            raise BadRequestError(f"This model's maximum context length is {self.fast_limit} tokens. However, you "
                                  f"requested 1708 tokens (1700 in the messages, 8 in the completion).")
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        await asyncio.sleep(0)
        return self._answer(kwargs)


class BadRequestError(Exception):
    """The shape of litellm's 400: a status code and the server's text."""

    status_code = 400


def models(method, url, body):
    """vLLM's /v1/models for the two fake servers."""
    return models_answer("fast-m", 2048) if url.startswith(FAST) else models_answer("slow-m", 16384)


def big_messages(n=140):
    return [{"role": "user", "content": f"{SECRET_WORD} check the disk latency graphs " * n}]


def make_session(state, http, client, tenant="acme-corp"):
    return Session(Backend("hosted_vllm/fast-m", api_base=FAST, name="fast"),
                   Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow"), state=state, tenant=tenant,
                   discovery=WindowDiscovery(http=http, state=None if isinstance(state, InProcessStore) else state),
                   session_id=f"{SECRET_WORD}-session", http=http, client=client, count_with_server=False,
                   warm_ahead=WarmAheadPolicy(timeout_s=5))


def test_keys_are_namespaced_and_carry_no_prompt_tenant_or_session_text(store):
    """After a warm and a correction, every key is under the namespace and no key or value holds the words sent."""
    s = make_session(store, FakeHttp(models), Answers(fast_limit=1200), tenant=f"{SECRET_WORD}-tenant")
    s.completion(messages=big_messages(), max_tokens=8)
    assert s.drain_warms(10) and s.stats()["warm_fired"] == 1
    keys = keys_of(store)
    assert keys and all(k.startswith(f"agentkv:{{{store.namespace}}}:") for k in keys)
    dump = " ".join(keys + [str(store.client.dump(k)) for k in keys])
    assert SECRET_WORD not in dump and "acme" not in dump
    assert store.client.zcard(store.keys.leases()) == 0  # the finished warm gave its lease back


def test_redis_down_skips_the_warm_counted_and_the_request_still_answers():
    """An unreachable store: the request is answered, the warm is skipped and counted, discovery uses its own cache."""
    from agentkv.testing.servers import free_port

    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", namespace="down")
    http = FakeHttp(models)
    s = make_session(store, http, Answers())
    s.completion(messages=big_messages(), max_tokens=8)
    assert s.stats()["warm_skipped_state_unavailable"] == 1 and s.stats()["warm_fired"] == 0
    assert s._parts.discovery.window(s.fast, model_known=False).window == 2048
    assert any(c.url.endswith("/models") for c in http.calls)


def test_the_in_process_store_is_the_default_and_keeps_todays_guards():
    """Without state= or AGENTKV_REDIS_URL a Session's store is the process's InProcessStore."""
    s = Session(Backend("a"), Backend("b"))
    assert isinstance(s._parts.state, InProcessStore) and s._parts.state is Session(Backend("c"))._parts.state


def test_agentkv_redis_url_gives_sessions_the_shared_store(redis_url, monkeypatch):
    """AGENTKV_REDIS_URL, read when a Session is made, selects a RedisStore on that URL."""
    monkeypatch.setenv("AGENTKV_REDIS_URL", redis_url)
    s = Session(Backend("a"), Backend("b"))
    assert isinstance(s._parts.state, RedisStore) and s._parts.state.url == redis_url


def test_configure_passes_the_store_to_decorated_sessions(store):
    """agentkv.configure(state=...) reaches the Session the bare decorator opens."""
    import agentkv

    previous = agentkv.configure(fast=Backend("a"), slow=Backend("b"), state=store)
    try:
        @agentkv.session
        def agent():
            return agentkv.current_session()._parts.state

        assert agent() is store
    finally:
        agentkv.configure(**previous)


class SyncSpy:
    """Wraps a redis client method and records calls made while an event loop runs on the calling thread."""

    def __init__(self, fn):
        self.fn, self.on_loop, self.calls = fn, [], 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        try:
            asyncio.get_running_loop()
            self.on_loop.append(args[:1])
        except RuntimeError:
            pass
        return self.fn(*args, **kwargs)


async def test_the_async_driver_uses_the_asyncio_client_only(store):
    """An async Session's claims, releases, window reads and correction writes never touch the sync client."""
    spies = {name: SyncSpy(getattr(store.client, name)) for name in ("execute_command", "pipeline")}
    for name, spy in spies.items():
        setattr(store.client, name, spy)
    http = FakeHttp(models)
    s = make_session(store, http, Answers(fast_limit=1200))
    await s.acompletion(messages=big_messages(), max_tokens=8)
    await s.adrain_warms(10)
    await asyncio.sleep(0.1)  # the correction's write is a task
    assert s.stats()["warm_fired"] == 1 and s.stats()["reactive_fallbacks"] == 1
    assert all(spy.on_loop == [] for spy in spies.values()) and http.blocking_calls == []
    assert store.read_window(f"{FAST}|hosted_vllm/fast-m").correction == 1200  # written through asyncio
    assert spies["execute_command"].on_loop  # the spy itself sees a sync call made on the loop
    assert store.client.zcard(store.keys.leases()) == 0


@pytest.fixture
def black_hole():
    """A port that accepts TCP connections and never answers: a Redis that is hung, not down."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    sock.close()


async def test_a_hung_redis_times_out_on_both_clients_and_then_fails_fast(black_hole):
    """A store that never answers raises StateUnavailable on the sync and asyncio paths, then backs off without I/O."""
    store = RedisStore.from_url(black_hole, namespace="hung", retry_s=60)
    with pytest.raises(StateUnavailable):
        await store.aclaim(claim())
    calls = []
    store.client.execute_command = lambda *a, **k: calls.append(a)  # backing off: no call reaches the client
    with pytest.raises(StateUnavailable):
        store.claim(claim())
    assert calls == []


def test_a_hung_redis_leaves_the_request_answered_and_the_warm_skipped(black_hole):
    """With Redis hung, the request is answered, its warm counted as skipped, and the window read from /models."""
    store = RedisStore.from_url(black_hole, namespace="hung")
    s = make_session(store, FakeHttp(models), Answers())
    s.completion(messages=big_messages(), max_tokens=8)
    assert s.stats()["warm_skipped_state_unavailable"] == 1 and s.stats()["requests"] == {"fast": 1}
    assert s.ledger[-1].backend == "fast"
