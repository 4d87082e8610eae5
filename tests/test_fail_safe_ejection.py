"""Issue 37, findings 2 and 4 and the exhausted pool: a replica is ejected on evidence that it is failing, never on one
request's failure; a conversation whose warmed replica is found dead is warmed again on its next replica at once; a
turn that no replica of a pool could take says so, naming each replica's state."""

from __future__ import annotations

import asyncio
import http.server
import threading
import uuid

import httpx
import pytest

from agentkv import Backend, RetryPolicy, Session, WindowDiscovery
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.errors import PoolExhaustedError
from agentkv.fleet import ranked
from agentkv.fleet.breaker import BreakerRule, ReplicaRecord
from agentkv.state import InProcessStore
from agentkv.testing import FakeHttp, capture_events, models_answer

TOOLS8 = TOOLS[:8]
MARKER = "POISON-7f3a"


class PoisonProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` that answers 504 to any request whose body holds
    ``MARKER`` (a proxy timing out one request), and passes everything else through; ``chats`` counts the chat
    completions it passed."""

    def __init__(self, upstream: str) -> None:
        proxy = self
        self.upstream, self.chats, self.poisoned = upstream, 0, 0
        self.client = httpx.Client(timeout=30)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._relay(b"")

            def do_POST(self) -> None:
                self._relay(self.rfile.read(int(self.headers.get("content-length") or 0)))

            def _relay(self, body: bytes) -> None:
                if MARKER.encode() in body:
                    proxy.poisoned += self.path.endswith("/chat/completions")
                    self._reply(504, b'{"error": {"message": "Gateway Timeout", "code": 504}}')
                    return
                if self.path.endswith("/chat/completions"):
                    proxy.chats += 1
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = proxy.client.request(self.command, proxy.upstream + self.path, content=body or None,
                                              headers=headers)
                self._reply(answer.status_code, answer.content)

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


@pytest.fixture(scope="module")
def replicas():
    """Three embedded replicas of one model (16384 tokens)."""
    from agentkv.embedded.server import LocalServer

    started = [LocalServer.from_size("tiny", window=16384, model_id="slow-tiny", seed=1, request_log=10_000).start()
               for _ in range(3)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def poisoned(replicas):
    """The replicas behind a poison proxy each: a pool of three."""
    proxies = [PoisonProxy(r.base_url) for r in replicas]
    yield proxies
    for proxy in proxies:
        proxy.close()


def grow(turns, seed=0):
    return ScriptedAgent(result_rows=1).conversation(turns, tag=f" (conversation {seed})")


# ----------------------------------------------------------------------------- finding 2: one request, no ejection

def test_one_poisoned_request_ejects_no_replica_and_moves_no_other_tenants_conversation(poisoned):
    """Finding 2: one turn of tenant A whose body a proxy answers with 504 on every replica fails (the pool is
    exhausted for that turn) but ejects none of the three; tenant B's 30 conversations then stay on their homes."""
    pool = Backend("hosted_vllm/slow-tiny", api_base=[p.url + "/v1" for p in poisoned], name="pool")
    store, discovery = InProcessStore(), WindowDiscovery()
    retry = RetryPolicy(sleep=lambda s: None)
    with Session(pool, tenant="tenant-a", state=store, discovery=discovery, retry=retry) as a:
        with capture_events() as events, pytest.raises(PoolExhaustedError, match="pool 'pool' exhausted"):
            a.completion(messages=[{"role": "user", "content": f"look up {MARKER} please"}], max_tokens=2)
        assert sum(p.poisoned for p in poisoned) == 3  # each replica was tried once for the turn
        assert a._parts.ejections.down(pool.replicas) == frozenset()

        async def again():  # the async path alike, from another of tenant A's conversations
            async with Session(pool, tenant="tenant-a", state=store, discovery=discovery, retry=retry) as a2:
                with pytest.raises(PoolExhaustedError):
                    await a2.acompletion(messages=[{"role": "user", "content": f"{MARKER} again"}], max_tokens=2)
        with capture_events() as more:
            asyncio.run(again())
        assert sum(p.poisoned for p in poisoned) == 6 and a._parts.ejections.down(pool.replicas) == frozenset()
    assert not [e for e in events + more if e["event"] == "replica_ejected"]
    away = []
    for i in range(30):
        with Session(pool, tenant="tenant-b", session_id=f"b-{i}", state=store, discovery=discovery,
                     retry=retry) as b:
            b.completion(messages=[{"role": "user", "content": f"conversation {i}: hello"}], max_tokens=2)
            served = next(iter(b.stats()["replica_requests"]))
            if served != b._parts.last_facts.homes["pool"]:
                away.append(i)
    assert away == []


def test_a_refused_connection_ejects_the_replica_at_once():
    """A connection refused is the replica's own failure: one is enough to eject it, for every conversation."""
    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    pool = Backend("hosted_vllm/m", api_base=[f"http://127.0.0.1:{p}/v1" for p in (11, 12, 13)], name="pool")
    with Session(pool, http=http, discovery=WindowDiscovery(http=http), count_with_server=False,
                 state=InProcessStore()) as s, capture_events() as events:
        attempt = s.prepare({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        moved = s.recover(attempt, httpx.ConnectError("[Errno 111] Connection refused"))
        assert moved.backend.api_base != attempt.backend.api_base
        assert s._parts.ejections.down(pool.replicas) == {attempt.backend.api_base}
    assert [e["replica"] for e in events if e["event"] == "replica_ejected"] == [attempt.backend.api_base]


def _caused(outer, inner):
    try:
        raise inner
    except BaseException as cause:
        try:
            raise outer from cause
        except BaseException as error:
            return error


class _Status(Exception):
    def __init__(self, code):
        super().__init__(f"status {code}")
        self.status_code = code


def test_what_a_failed_try_says_about_its_replica():
    """A refusal, an unreachable host or a reset says the replica is down; a 504, a connection closed without an
    answer or a timeout the policy fails over is this request's failure; anything else says nothing."""
    from agentkv.retry import replica_evidence, replica_state

    refused = _caused(httpx.ConnectError("refused"), ConnectionRefusedError(111, "Connection refused"))
    reset = _caused(httpx.ReadError("reset"), ConnectionResetError(104, "Connection reset by peer"))
    assert replica_evidence(refused, fails_over=True) == "down" and replica_state(refused) == "refused"
    assert replica_evidence(reset, fails_over=True) == "down"
    assert replica_evidence(_Status(504), fails_over=True) == "failed"
    assert replica_state(_Status(504)) == "unavailable (504)"
    assert replica_evidence(httpx.RemoteProtocolError("Server disconnected"), fails_over=True) == "failed"
    assert replica_evidence(httpx.ReadTimeout("slow"), fails_over=True) == "failed"
    assert replica_evidence(httpx.ReadTimeout("slow"), fails_over=False) is None
    assert replica_evidence(_Status(400), fails_over=False) is None


# ----------------------------------------------------------------------------- the breaker, pure

def _fed(rule, *observations):
    record, verdicts = ReplicaRecord(), []
    for conversation, tenant, evidence, at in observations:
        record, verdict = record.observe(conversation, tenant, evidence, at, rule)
        verdicts.append(verdict)
    return verdicts


def test_the_breaker_ejects_on_a_refusal_at_once_and_on_consecutive_failures_of_several_conversations():
    """A refusal or reset trips at once (shared); three failures in a row from two conversations of two tenants within
    the window trip it (shared); a success between them, or a failure outside the window, starts the count again."""
    rule = BreakerRule(failures=3, conversations=2, tenants=2, window_s=30.0)
    assert _fed(rule, ("c1", "t1", "down", 0.0))[-1].eject
    assert _fed(rule, ("c1", "t1", "down", 0.0))[-1].shared
    tripped = _fed(rule, ("c1", "t1", "failed", 0.0), ("c2", "t2", "failed", 1.0), ("c1", "t1", "failed", 2.0))
    assert [v.eject for v in tripped] == [False, False, True] and tripped[-1].shared
    reset = _fed(rule, ("c1", "t1", "failed", 0.0), ("c2", "t2", "failed", 1.0), ("c3", "t2", "ok", 1.5),
                 ("c1", "t1", "failed", 2.0))
    assert not any(v.eject for v in reset)
    stale = _fed(rule, ("c1", "t1", "failed", 0.0), ("c2", "t2", "failed", 1.0), ("c1", "t1", "failed", 40.0))
    assert not any(v.eject for v in stale)


def test_one_tenant_alone_cannot_eject_a_replica_another_tenant_uses():
    """Failures from one tenant, however many conversations, trip no breaker on a replica another tenant used in the
    window; on a replica only that tenant used, they eject it for this process alone (not shared)."""
    rule = BreakerRule()
    shared_use = _fed(rule, ("b1", "tb", "ok", 0.0), *[(f"a{i}", "ta", "failed", 1.0 + i) for i in range(10)])
    assert not any(v.eject for v in shared_use)
    alone = _fed(rule, *[(f"a{i}", "ta", "failed", 1.0 + i) for i in range(3)])
    assert alone[-1].eject and not alone[-1].shared
    one_conversation = _fed(rule, *[("a1", "ta", "failed", 1.0 + i) for i in range(10)])
    assert not any(v.eject for v in one_conversation)


def test_a_tenant_that_ejects_a_replica_it_used_alone_ejects_it_for_itself_only():
    """Tenant B used a replica and went quiet (think time past the window); tenant A's three poisoned turns then trip
    its breaker on A's evidence alone: the replica is out for A's conversations, never for B's or anyone else's in this
    process, and never in the store."""
    from agentkv.state import Ejections
    from agentkv.testing import FakeClock

    clock, store = FakeClock(), InProcessStore()
    ejections = Ejections(store, clock=clock, refresh_s=0.0)
    replica = "http://r1:8000/v1"
    ejections.observe(replica, "ok", session="b1", tenant="tenant-b")
    clock.advance(31)
    verdicts = [ejections.observe(replica, "failed", session=f"a{i % 2}", tenant="tenant-a") for i in range(3)]
    assert verdicts[-1].eject and not verdicts[-1].shared
    assert ejections.down([replica], "tenant-a") == {replica}
    assert ejections.down([replica], "tenant-b") == frozenset() and ejections.down([replica]) == frozenset()
    assert store.read_down([replica]) == frozenset()


def test_the_breakers_memory_is_bounded():
    """However many tenants and failures it is fed, a replica's record keeps a bounded number of entries."""
    rule = BreakerRule()
    record = ReplicaRecord()
    for i in range(10_000):
        record, _ = record.observe(f"c{i}", f"t{i}", "ok" if i % 2 else "failed", float(i) / 1000, rule)
    assert len(record.streak) <= 32 and len(record.users) <= 64


def test_ejections_carry_out_the_breakers_verdicts_and_share_only_evidence_from_several_tenants():
    """Through :class:`Ejections` (its own clock): tenant A's failures on a replica tenant B uses eject nothing; once B's
    conversation fails too, the replica is ejected and marked in the store; A alone on another replica ejects it in
    this process only; a cool-off over, the breaker counts afresh."""
    from agentkv.state import Ejections
    from agentkv.testing import FakeClock

    clock, store = FakeClock(), InProcessStore()
    ejections = Ejections(store, clock=clock)
    shared, alone = "http://shared:8000/v1", "http://alone:8000/v1"
    ejections.observe(shared, "ok", session="b1", tenant="tenant-b")
    for i in range(5):
        clock.advance(1)
        assert not ejections.observe(shared, "failed", session=f"a{i}", tenant="tenant-a").eject
    clock.advance(1)
    verdict = ejections.observe(shared, "failed", session="b1", tenant="tenant-b", cooloff_s=10)
    assert verdict.eject and verdict.shared and store.read_down([shared]) == {shared}
    for i in range(3):
        clock.advance(1)
        verdict = ejections.observe(alone, "failed", session=f"a{i}", tenant="tenant-a", cooloff_s=10)
    assert verdict.eject and not verdict.shared
    assert ejections.down([alone], "tenant-a") == {alone} and store.read_down([alone]) == frozenset()
    assert ejections.down([alone], "tenant-b") == frozenset() and ejections.down([alone]) == frozenset()
    clock.advance(11)
    assert not ejections.observe(alone, "failed", session="a9", tenant="tenant-a").eject


# ----------------------------------------------------------------------------- the exhausted pool

def test_an_exhausted_pool_says_so_and_names_each_replicas_state():
    """Every replica of a pool down for a turn: the error says the pool is exhausted and names each replica (redacted)
    with what happened to it: refused this turn, or ejected with its cool-off left; no retry sleeps."""
    slept: list[float] = []
    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    urls = [f"http://user:pw@127.0.0.1:{p}/v1?api_key=sk-secret" for p in (21, 22, 23)]
    pool = Backend("hosted_vllm/m", api_base=urls, name="pool")
    store = InProcessStore()

    def refused(**kwargs):
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as cause:
            raise httpx.ConnectError("[Errno 111] Connection refused") from cause

    class Client:
        def completion(self, **kwargs):
            return refused(**kwargs)

    with Session(pool, http=http, discovery=WindowDiscovery(http=http), count_with_server=False, state=store,
                 client=Client(), retry=RetryPolicy(attempts=2, sleep=slept.append, replica_cooloff_s=30.0)) as s:
        s._parts.ejections.mark(urls[2], 30.0)  # one is already cooling off: the turn's two tries go to the others
        with pytest.raises(PoolExhaustedError) as caught:
            s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    message = str(caught.value)
    assert message.startswith("pool 'pool' exhausted: ")
    assert "user" not in message and "pw" not in message and "sk-secret" not in message
    assert "http://127.0.0.1:21/v1 refused" in message and "http://127.0.0.1:22/v1 refused" in message
    assert "http://127.0.0.1:23/v1 ejected (cooling off" in message
    assert isinstance(caught.value.__cause__, httpx.ConnectError) and slept == []
    assert set(caught.value.replicas) == {"http://127.0.0.1:21/v1", "http://127.0.0.1:22/v1", "http://127.0.0.1:23/v1"}


def test_a_flapping_replica_fails_no_turn():
    """A replica that refuses every other request: each turn that meets it refused moves to the next replica and is
    answered; no turn fails."""
    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    pool = Backend("hosted_vllm/m", api_base=[f"http://127.0.0.1:{p}/v1" for p in (31, 32, 33)], name="pool")
    flaps = {"n": 0}

    class Client:
        def completion(self, **kwargs):
            if kwargs["api_base"].endswith(":31/v1"):
                flaps["n"] += 1
                if flaps["n"] % 2:
                    raise httpx.ConnectError("[Errno 111] Connection refused")
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

    store, failed = InProcessStore(), 0
    for i in range(60):
        with Session(pool, http=http, discovery=WindowDiscovery(http=http), count_with_server=False, state=store,
                     client=Client(), retry=RetryPolicy(sleep=lambda s: None, replica_cooloff_s=0.001),
                     session_id=f"flap-{i}") as s:
            try:
                s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            except Exception:  # noqa: BLE001 - a failed turn is what this test counts
                failed += 1
    assert failed == 0 and flaps["n"] > 0


# ----------------------------------------------------------------------------- finding 4: re-warm at detection

def _escalating_turns(fast, slow, history):
    """(the first turn whose warm fires, the last fast turn, the escalation) of ``history`` on a fresh Session."""
    fired = last_fast = None
    with Session(fast, slow, discovery=WindowDiscovery(), state=InProcessStore(),
                 session_id=f"dry-{uuid.uuid4()}") as dry:
        for turn, msgs in enumerate(history):
            dry.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
            dry.drain_warms(30)
            if dry.last_route.role == "slow":
                return fired, last_fast, turn
            if fired is None and dry.stats()["warm_fired"]:
                fired = turn
            last_fast = turn
    raise AssertionError("the conversation never escalated")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_warmed_replica_found_dead_is_rewarmed_on_the_next_one_before_the_escalation(servers, replicas,
                                                                                       asynchronous):
    """Finding 4: the replica holding a conversation's warm is killed after its warm; the health check of the next
    (last) fast turn finds it dead, the conversation is warmed again on its next replica at once, in the background,
    and the escalation that follows reads that warm."""
    from agentkv.embedded.server import LocalServer

    fast_server = servers[0]
    fast_server.max_model_len = 2048
    fast = Backend(f"hosted_vllm/{fast_server.model_id}", api_base=fast_server.api_base, name="fast")
    extra = LocalServer.from_size("tiny", window=16384, model_id="slow-tiny", seed=1, request_log=10_000).start()
    pool = [extra.api_base, replicas[0].api_base, replicas[1].api_base]
    slow = Backend("hosted_vllm/slow-tiny", api_base=pool, name="slow")
    history = grow(16, seed=40 + asynchronous)
    try:
        fired, last_fast, escalation = _escalating_turns(
            fast, Backend("hosted_vllm/slow-tiny", api_base=replicas[2].api_base), history)
        assert fired is not None and fired < last_fast
        prefix = f"rw-{uuid.uuid4()}"  # warm cooldowns are the process's: no other test's conversation shares an id
        sid = next(f"{prefix}-{i}" for i in range(1000)
                   if ranked(Session(fast, slow, session_id=f"{prefix}-{i}").routing_key, pool)[0] == extra.api_base)
        s = Session(fast, slow, discovery=WindowDiscovery(), state=InProcessStore(), session_id=sid,
                    cache_salt=f"salt-{uuid.uuid4()}")  # nothing cached on any replica but what this test sends
        if asynchronous:
            async def converse():
                events = []
                for turn in [*range(fired + 1), "kill", last_fast, escalation]:
                    if turn == "kill":
                        extra.stop()
                        continue
                    with capture_events() as seen:
                        await s.acompletion(messages=history[turn], tools=TOOLS8, max_tokens=2)
                        await s.adrain_warms(30)
                    events.append(seen)
                return events
            events = asyncio.run(converse())
        else:
            events = []
            for turn in [*range(fired + 1), "kill", last_fast, escalation]:
                if turn == "kill":
                    extra.stop()
                    continue
                with capture_events() as seen:
                    s.completion(messages=history[turn], tools=TOOLS8, max_tokens=2)
                    s.drain_warms(30)
                events.append(seen)
        escalated, last_fast_row = s.ledger[-1], s.ledger[-2]
        assert escalated.backend == "slow" and last_fast_row.backend == "fast"
        assert escalated.cached_tokens >= 0.9 * last_fast_row.input_tokens, [e["event"] for e in events[-2]]
        moved = [e for e in events[-2] if e["event"] == "warm_replica_moved"]
        assert len(moved) == 1, [e["event"] for e in events[-2]]  # detected and warmed again on the last fast turn
        assert [e for e in events[-2] if e["event"] == "replica_ejected"]
        assert moved[0]["estimate"] == last_fast_row.input_tokens
        sent = [r.body for r in replicas[0].requests + replicas[1].requests if r.path == "/v1/chat/completions"
                and r.body.get("cache_salt") == s._parts.cache_salt]
        assert [b["max_tokens"] for b in sent] == [1, 2]  # the re-warm reached the next replica, then the escalation
        assert s.stats()["warm_failed"] == 0
        s.close()
    finally:
        extra.stop()
