"""A tier of many replicas: the routing key on every request, a caller's routing headers on its warm, a pool's replicas
chosen by rendezvous hashing with bounded loads, ejected when down, and a conversation re-warmed on its next replica."""

import uuid

import pytest

from agentkv import Backend, RetryPolicy, Session, WindowDiscovery
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.fleet import affinity_missed, choose, forwardable_headers, ranked, routing_headers, routing_key
from agentkv.state import Ejections, InProcessStore
from agentkv.state.memory import new_home
from agentkv.testing import FakeClock, capture_events

TOOLS8 = TOOLS[:8]
KEY_HEADER = "x-session-id"


def grow(turns, seed=0):
    return ScriptedAgent(result_rows=1).conversation(turns, tag=f" (conversation {seed})")


# ----------------------------------------------------------------------------- pure parts

def test_the_routing_key_is_an_opaque_stable_digest():
    """The key is 32 hex characters, the same in every process for one (tenant, session, secret), different when any
    of them differs, and contains neither the tenant's name nor the session id."""
    key = routing_key("acme-corp", "conversation-42", "s3cret")
    assert len(key) == 32 and int(key, 16) >= 0
    assert key == routing_key("acme-corp", "conversation-42", "s3cret")
    others = {routing_key("acme-corp", "conversation-43", "s3cret"), routing_key("other", "conversation-42", "s3cret"),
              routing_key("acme-corp", "conversation-42", "other"), routing_key(None, "conversation-42", "s3cret")}
    assert key not in others and len(others) == 4
    assert "acme" not in key and "42" not in key.replace(key, "")


def test_a_callers_credentials_never_ride_on_a_warm():
    """Forwardable headers are the allowed names only (credentials, hop-by-hop and body headers never are); a caller's
    own session header wins over the key; the set is bounded."""
    caller = {"X-Session-ID": "theirs", "X-Team": "a", "Authorization": "Bearer sk-1", "x-api-key": "k", "Cookie": "c",
              "Content-Length": "9", "Host": "h", "X-Stainless-Retry-Count": "0", "X-Auth-Token": "t",
              "x-goog-api-key": "g", "Ocp-Apim-Subscription-Key": "o", "apikey": "a", "X-Auth": "x", "Helicone-Auth": "h",
              "X-Access-Key": "k", "x-functions-key": "f", "X-Amz-Security-Token": "s", "X-Signature": "s"}
    assert forwardable_headers(caller) == {}
    assert forwardable_headers(caller, ("x-session-id", "X-Team")) == {"X-Session-ID": "theirs", "X-Team": "a"}
    keyed = Backend("hosted_vllm/m", api_base="http://127.0.0.1:1/v1", affinity_headers=("X-Routing-Key",))
    assert routing_headers(keyed, None, {"X-Routing-Key": "r", "X-Api-Key": "k"}) == {"X-Routing-Key": "r"}
    assert forwardable_headers({"X-Big": "v" * 9000, "X-Session-ID": "s"}, ("X-Big", "X-Session-ID")) == {
        "X-Session-ID": "s"}
    backend = Backend("hosted_vllm/m", api_base="http://127.0.0.1:1/v1")
    assert routing_headers(backend, "k" * 32, caller)["X-Session-ID"] == "theirs"
    assert routing_headers(backend, "k" * 32, {}) == {"X-Session-ID": "k" * 32}
    many = {f"X-H{i}": "v" * 100 for i in range(500)}
    assert len(forwardable_headers(many, tuple(many))) <= 32


def test_rendezvous_moves_only_the_conversations_of_a_replica_that_leaves():
    """Removing one of four replicas moves exactly the conversations it served; the rest keep theirs, and when it
    comes back exactly those return."""
    replicas = [f"http://10.0.0.{i}:8000/v1" for i in range(4)]
    keys = [uuid.uuid4().hex for _ in range(2000)]
    before = {k: choose(k, replicas) for k in keys}
    after = {k: choose(k, replicas, down={replicas[2]}) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == replicas[2]}
    assert all(after[k] == ranked(k, replicas)[1] for k in moved)
    assert {k: choose(k, replicas) for k in keys} == before
    assert choose(keys[0], replicas, tried=set(replicas)) is None


def test_homes_spread_thirty_conversations_evenly_over_three_replicas():
    """Bounded-load homes put 30 conversations 10/10/10 on three replicas (hashing alone is often past 1.5)."""
    replicas = ["http://a/v1", "http://b/v1", "http://c/v1"]
    store = InProcessStore()
    homes = [store.home_replica("pool", k, ranked(k, replicas), (), slack=1.0, idle_s=600)
             for k in (uuid.uuid4().hex for _ in range(30))]
    counts = [homes.count(r) for r in replicas]
    assert max(counts) / min(counts) <= 1.5 and sum(counts) == 30
    assert new_home(["a", "b"], {"a"}, ["b"] * 5, 1.0) == "b"  # a down replica takes no new home


def test_a_home_is_kept_while_active_and_forgotten_when_idle():
    """A conversation keeps its home across requests (even while it is down: it comes back to it), and loses it once
    idle past ``idle_s``."""
    clock = FakeClock()
    store = InProcessStore(clock=clock)
    order = ("http://a/v1", "http://b/v1")
    assert store.home_replica("p", "c1", order, (), slack=1.0, idle_s=60) == "http://a/v1"
    assert store.home_replica("p", "c1", order, {"http://a/v1"}, slack=1.0, idle_s=60) == "http://a/v1"
    assert store.home_replica("p", "c2", order, (), slack=1.0, idle_s=60) == "http://b/v1"
    clock.advance(61)
    assert store.home_replica("p", "c2", order[::-1][::-1], (), slack=1.0, idle_s=60) == "http://a/v1"


def test_ejections_expire_and_are_read_from_the_store():
    """A mark holds for its cool-off; another process's mark (the store's) is seen within ``refresh_s`` and ends with
    it; this process's own stays out, on probation, until a health check confirms the replica up."""
    clock = FakeClock()
    store = InProcessStore(clock=clock)
    mine, theirs = Ejections(store, clock=clock), Ejections(store, refresh_s=1.0, clock=clock)
    assert theirs.down(["u1", "u2"]) == frozenset()
    mine.mark("u1", 10)
    assert mine.down(["u1", "u2"]) == {"u1"}
    assert theirs.down(["u1", "u2"]) == frozenset()  # its cached read is fresh
    clock.advance(1.5)
    assert theirs.down(["u1", "u2"]) == {"u1"}
    clock.advance(10)
    assert theirs.down(["u1", "u2"]) == frozenset()  # the store's mark ended
    assert mine.down(["u1", "u2"]) == {"u1"} and mine.on_probation(["u1", "u2"]) == ["u1"]  # until a check says up
    mine.confirm("u1")
    assert mine.down(["u1", "u2"]) == frozenset() and mine.on_probation(["u1"]) == []


def test_affinity_miss_needs_a_real_prefix_and_a_real_shortfall():
    """A miss is cached under half of an expected prefix of at least 256 tokens; unknowns are never misses."""
    assert affinity_missed(4000, 100) and not affinity_missed(4000, 3900)
    assert not affinity_missed(200, 0) and not affinity_missed(None, 0) and not affinity_missed(4000, None)


def test_a_backend_pool_is_checked_before_anything_is_sent():
    """A pool lists http(s) URLs, each once; affinity headers are header names."""
    from agentkv.errors import ConfigurationError

    pool = Backend("hosted_vllm/m", api_base=["http://a/v1", "http://b/v1"])
    assert pool.is_pool and pool.api_base == "http://a/v1" and pool.replica("http://b/v1").api_base == "http://b/v1"
    assert Backend("hosted_vllm/m", api_base=["http://a/v1"]).is_pool is False
    for bad in (["http://a/v1", "ftp://b"], ["http://a/v1", "http://a/v1/"]):
        with pytest.raises(ConfigurationError, match="api_base"):
            Backend("hosted_vllm/m", api_base=bad)
    with pytest.raises(ConfigurationError, match="affinity_headers"):
        Backend("hosted_vllm/m", affinity_headers=("X Session",))
    with pytest.raises(ConfigurationError, match="affinity_headers"):
        Backend("hosted_vllm/m", affinity_headers="X-Session-ID")


# ----------------------------------------------------------------------------- against embedded replicas

@pytest.fixture(scope="module")
def replicas():
    """Three embedded replicas of one slow model (16384 tokens), logging their requests and headers."""
    from agentkv.embedded.server import LocalServer

    started = [LocalServer.from_size("tiny", window=16384, model_id="slow-tiny", seed=1, request_log=10_000).start()
               for _ in range(3)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def tier(servers, replicas):
    fast_server = servers[0]
    fast_server.max_model_len = 2048
    for server in (fast_server, *replicas):
        server.clear_requests()
    fast = Backend(f"hosted_vllm/{fast_server.model_id}", api_base=fast_server.api_base, name="fast")
    slow = Backend("hosted_vllm/slow-tiny", api_base=[r.api_base for r in replicas], name="slow",
                   forward_headers=("X-Team",))  # a caller's X-Team rides on its warms (nothing unnamed does)
    return {"fast": fast, "slow": slow, "fast_server": fast_server, "replicas": replicas}


def session(tier, **kwargs):
    kwargs.setdefault("session_id", f"c-{uuid.uuid4()}")
    return Session(tier["fast"], tier["slow"], discovery=WindowDiscovery(), state=kwargs.pop("state", InProcessStore()),
                   **kwargs)


def chats(server):
    return [r for r in server.requests if r.path == "/v1/chat/completions"]


def run_to_slow(s, history, extra_turns=1, **kwargs):
    """Drive turns until the conversation has escalated and had ``extra_turns`` more slow turns."""
    slow_turns = 0
    for msgs in history:
        s.completion(messages=msgs, tools=TOOLS8, max_tokens=2, **kwargs)
        s.drain_warms(30)
        if s.last_route.role == "slow":
            slow_turns += 1
            if slow_turns > extra_turns:
                return
    raise AssertionError("the conversation never escalated")


def test_every_request_of_a_conversation_carries_its_key_and_lands_on_one_replica(tier):
    """The warm, the escalation and the later slow turns all reach one replica, each with the conversation's key in
    X-Session-ID (never the session id or the tenant); fast's turns carry it too; the escalation reads the warm."""
    with session(tier, tenant="acme", cache_salt_secret="k", session_id="plain-session-name") as s:
        run_to_slow(s, grow(14))
    used = [r for r in tier["replicas"] if chats(r)]
    assert len(used) == 1
    sent = chats(used[0])
    assert sent[0].body["max_tokens"] == 1 and len(sent) >= 3  # the warm, then the slow turns
    assert {r.headers.get(KEY_HEADER) for r in sent + chats(tier["fast_server"])} == {s.routing_key}
    assert "plain-session-name" not in s.routing_key and "acme" not in s.routing_key
    escalated = next(e for e in s.ledger if e.backend == "slow")
    warmed = next(e for e in s.ledger if e.warm == "fire").input_tokens
    assert escalated.cached_tokens >= 0.9 * warmed
    assert s.stats()["replica_requests"] == {used[0].api_base: s.stats()["requests"]["slow"]}
    assert s.stats()["affinity_misses"] == 0


def test_a_callers_routing_headers_ride_on_its_warm_without_credentials(tier):
    """A caller's extra_headers reach its own turns and its warm (their session header wins over the key), and its
    Authorization does not reach the warm."""
    headers = {"X-Session-ID": "caller-7", "X-Team": "search", "Authorization": "Bearer sk-caller"}
    with session(tier) as s:
        run_to_slow(s, grow(12), extra_turns=0, extra_headers=headers)
    warm = next(r for rep in tier["replicas"] for r in chats(rep) if r.body["max_tokens"] == 1)
    assert warm.headers.get(KEY_HEADER) == "caller-7" and warm.headers.get("x-team") == "search"
    assert "authorization" not in warm.headers
    assert {r.headers.get(KEY_HEADER) for r in chats(tier["fast_server"])} == {"caller-7"}


def test_a_killed_replica_loses_no_turn_and_its_conversation_is_warmed_again(tier):
    """The replica holding a conversation's warm dies before its escalation: a health check ejects it, the next turn
    warms the conversation's next replica, and the escalation reads that warm; no turn is lost."""
    from agentkv.embedded.server import LocalServer

    extra = LocalServer.from_size("tiny", window=16384, model_id="slow-tiny", seed=1, request_log=10_000).start()
    pool = [r.api_base for r in tier["replicas"][:2]] + [extra.api_base]
    slow = Backend("hosted_vllm/slow-tiny", api_base=pool, name="slow")
    history = grow(14)
    try:
        sid = next(f"c{i}" for i in range(1000)  # a conversation whose first choice is the disposable replica
                   if ranked(Session(tier["fast"], slow, session_id=f"c{i}").routing_key, pool)[0] == extra.api_base)
        with Session(tier["fast"], slow, discovery=WindowDiscovery(), state=InProcessStore(), session_id=sid) as s:
            turn = 0
            while s.stats()["warm_fired"] == 0:
                s.completion(messages=history[turn], tools=TOOLS8, max_tokens=2)
                s.drain_warms(30)
                turn += 1
            assert s._parts.last_facts.homes["slow"] == extra.api_base and chats(extra)
            extra.stop()
            with capture_events() as events:
                for msgs in history[turn:]:
                    assert s.completion(messages=msgs, tools=TOOLS8, max_tokens=2).choices
                    s.drain_warms(30)
                    if s.last_route.role == "slow":
                        break
            assert s.stats()["warm_fired"] == 2, [e["event"] for e in events]
            assert any(e["event"] == "replica_ejected" for e in events)
            escalated = s.ledger[-1]
            second_warm = [e for e in s.ledger if e.warm == "fire"][-1].input_tokens
            assert escalated.backend == "slow" and escalated.cached_tokens >= 0.9 * second_warm
    finally:
        extra.stop()


def test_an_outage_on_a_replica_moves_the_turn_to_the_next_one_without_retrying_it(tier):
    """A slow turn whose replica is down goes to the conversation's next replica at once (no retry sleep on the dead
    one, no failover to fast), and the replica is ejected for the others."""
    from agentkv.embedded.server import LocalServer

    extra = LocalServer.from_size("tiny", window=16384, model_id="slow-tiny", seed=1, request_log=10_000).start()
    slept = []
    pool = [extra.api_base, *[r.api_base for r in tier["replicas"][:2]]]
    slow = Backend("hosted_vllm/slow-tiny", api_base=pool, name="slow")
    store = InProcessStore()
    try:
        for attempt in range(40):  # find a conversation whose home is the disposable replica
            s = Session(tier["fast"], slow, discovery=WindowDiscovery(), state=store, session_id=f"c{attempt}",
                        retry=RetryPolicy(sleep=slept.append), warm_ahead=__import__("agentkv").WarmAheadPolicy(
                            threshold=0.99))
            s.completion(messages=grow(1)[0], max_tokens=2)
            if s._parts.last_facts.homes["slow"] == extra.api_base:
                break
            s.close()
        extra.stop()
        answer = s.completion(messages=grow(14)[14], tools=TOOLS8, max_tokens=2)
        assert answer.choices and s.last_route.role == "slow" and slept == []
        assert s.stats()["replica_failovers"] == 1 and s.stats()["failovers"] == 0
        assert extra.api_base in s._parts.ejections.down(pool)
        s.close()
    finally:
        extra.stop()


@pytest.mark.asyncio
async def test_the_async_path_routes_and_keys_alike(tier):
    """acompletion addresses the same replica with the same key as completion would."""
    async with session(tier) as s:
        history = grow(14)
        for msgs in history:
            await s.acompletion(messages=msgs, tools=TOOLS8, max_tokens=2)
            await s.adrain_warms(30)
            if s.last_route.role == "slow":
                break
    used = [r for r in tier["replicas"] if chats(r)]
    assert len(used) == 1 and {r.headers.get(KEY_HEADER) for r in chats(used[0])} == {s.routing_key}


# ----------------------------------------------------------------------------- shared through a real Redis

def test_redis_shares_homes_and_ejections_between_processes(redis_url):
    """Two RedisStores (two processes' views) on one Redis: a conversation gets one home from both, thirty spread
    10/10/10, a replica marked down by one is down for the other, and the mark ends with its cool-off."""
    import time

    from agentkv.state import RedisStore

    namespace = f"fleet-{uuid.uuid4()}"
    one, two = (RedisStore.from_url(redis_url, namespace=namespace, timeout_s=1.0) for _ in range(2))
    replicas = ("http://a/v1", "http://b/v1", "http://c/v1")
    keys = [uuid.uuid4().hex for _ in range(30)]
    homes = [one.home_replica("pool", k, ranked(k, replicas), (), slack=1.0, idle_s=60) for k in keys]
    assert [two.home_replica("pool", k, ranked(k, replicas)[::-1], (), slack=1.0, idle_s=60) for k in keys] == homes
    assert sorted(homes.count(r) for r in replicas) == [10, 10, 10]
    fresh = uuid.uuid4().hex
    assert two.home_replica("pool", fresh, ranked(fresh, replicas), {"http://a/v1", "http://b/v1"}, slack=1.0,
                            idle_s=60) == "http://c/v1"
    one.mark_down("http://b/v1", 0.3)
    assert two.read_down(list(replicas)) == {"http://b/v1"}
    time.sleep(0.4)
    assert two.read_down(list(replicas)) == frozenset()


async def test_redis_homes_and_ejections_async(redis_url):
    """The async twins answer as the sync calls do."""
    from agentkv.state import RedisStore

    store = RedisStore.from_url(redis_url, namespace=f"fleet-{uuid.uuid4()}", timeout_s=1.0)
    order = ("http://a/v1", "http://b/v1")
    assert await store.ahome_replica("p", "c1", order, (), slack=1.0, idle_s=60) == "http://a/v1"
    assert store.home_replica("p", "c1", order, (), slack=1.0, idle_s=60) == "http://a/v1"
    await store.amark_down("http://a/v1", 5)
    assert await store.aread_down(list(order)) == {"http://a/v1"}


def test_the_openai_transport_keys_its_tries_and_forwards_the_clients_headers_to_the_warm(tier):
    """Through the OpenAI SDK's transport: the slow pool's replica gets the warm and the escalation, each try carries
    the key, and the client's own X-Session-ID and X-Team (not its api key) ride on the warm."""
    import httpx
    import openai

    from agentkv.integrations.openai import AgentKVTransport

    with session(tier) as s:
        client = openai.OpenAI(base_url=tier["fast_server"].api_base, api_key="sk-client", max_retries=0,
                               default_headers={"X-Team": "search"},
                               http_client=httpx.Client(transport=AgentKVTransport(s)))
        for msgs in grow(14, seed=3):
            client.chat.completions.create(model="fast-tiny", messages=msgs, tools=TOOLS8, max_tokens=2)
            s.drain_warms(30)
            if s.last_route.role == "slow":
                break
    used = [r for r in tier["replicas"] if chats(r)]
    assert len(used) == 1
    warm, escalation = chats(used[0])[:2]
    assert warm.body["max_tokens"] == 1 and warm.headers.get("x-team") == "search"
    assert "authorization" not in warm.headers and escalation.headers.get("authorization") == "<redacted>"  # logged so
    assert {r.headers.get(KEY_HEADER) for r in chats(used[0])} == {s.routing_key}


def test_chat_agentkv_sends_the_key_through_real_chatopenai_models(tier):
    """ChatAgentKV over real ChatOpenAI models: each try carries the conversation's key in X-Session-ID, fast's and
    slow's alike (slow here is one replica of the pool, as ChatOpenAI addresses one URL)."""
    from langchain_core.messages import convert_to_messages
    from langchain_openai import ChatOpenAI

    from agentkv.integrations.langchain import ChatAgentKV

    replica = tier["replicas"][0]
    slow = Backend("hosted_vllm/slow-tiny", api_base=replica.api_base, name="slow")
    with Session(tier["fast"], slow, discovery=WindowDiscovery(), state=InProcessStore()) as s:
        fast_model = ChatOpenAI(model=tier["fast_server"].model_id, base_url=tier["fast_server"].api_base, api_key="-",
                                max_tokens=2)
        slow_model = ChatOpenAI(model="slow-tiny", base_url=replica.api_base, api_key="-", max_tokens=2)
        router = ChatAgentKV(fast_model, slow_model, s).bind_tools(TOOLS8)
        router.invoke(convert_to_messages(grow(1, seed=5)[1]))
        router.invoke(convert_to_messages(grow(14, seed=5)[14]))
        assert router.last_role == "slow"
    sent = chats(tier["fast_server"]) + [r for r in chats(replica) if r.body.get("max_tokens") != 1]
    assert len(sent) >= 2 and {r.headers.get(KEY_HEADER) for r in sent} == {s.routing_key}


# ----------------------------------------------------------------------------- a cache ledger over a pool

@pytest.fixture(scope="module")
def evented_pool(servers):
    """Three embedded replicas publishing KV events, and a ledger following each of them."""
    from agentkv.cache_ledger import CacheLedger
    from agentkv.embedded.server import LocalServer

    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    started = [LocalServer.from_size("tiny", window=16384, model_id="ev-slow", seed=1, kv_events_config=events,
                                     request_log=10_000).start() for _ in range(3)]
    pool = Backend("hosted_vllm/ev-slow", api_base=[s.api_base for s in started], name="slow",
                   kv_events=[s.kv_events.endpoint for s in started],
                   kv_events_replay=[s.kv_events.replay_endpoint for s in started])
    try:
        with CacheLedger([pool]) as ledger:
            yield {"servers": started, "pool": pool, "ledger": ledger}
    finally:
        for server in started:
            server.stop()


def test_a_ledger_follows_every_replica_and_a_resident_warm_is_skipped_on_the_conversations_replica(servers,
                                                                                                evented_pool):
    """The ledger follows each replica under its own name; the same conversation in a second Session finds its
    prefix resident on its home and sends no warm; another conversation, homed elsewhere, warms its own replica."""
    from agentkv import WarmAheadPolicy

    pool, ledger = evented_pool["pool"], evented_pool["ledger"]
    assert sorted(ledger.backends) == sorted(pool.replica(u).replica_name for u in pool.replicas)
    servers[0].max_model_len = 2048
    fast = Backend(f"hosted_vllm/{servers[0].model_id}", api_base=servers[0].api_base, name="fast")
    store, policy = InProcessStore(), WarmAheadPolicy(cooldown_s=300)
    system = "You are a careful agent that reads the whole file before acting. " * 90
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Start."},
                {"role": "assistant", "content": "Done step 0."},
                {"role": "user", "content": "Step 0: " + "read the next file carefully " * 6}]

    def one(session_id):
        s = Session(fast, pool, tenant="acme", cache_salt_secret="k", session_id=session_id, state=store,
                    discovery=WindowDiscovery(), cache_ledger=ledger, warm_ahead=policy)
        s.completion(messages=messages, max_tokens=2)
        assert s.drain_warms(60)
        return s

    first = one("conversation-1")
    home = first._parts.last_facts.homes["slow"]
    assert first.stats()["warm_fired"] == 1, (first.ledger[-1], first.stats())
    from agentkv.warm import CooldownMap

    # the same conversation in another process (a store of its own, with its own cooldowns): the same home
    again = Session(fast, pool, tenant="acme", cache_salt_secret="k", session_id="conversation-1",
                    state=InProcessStore(cooldowns=CooldownMap()), discovery=WindowDiscovery(), cache_ledger=ledger,
                    warm_ahead=policy)
    with capture_events() as events:
        again.completion(messages=messages, max_tokens=2)
        assert again.drain_warms(60)
    assert again._parts.last_facts.homes["slow"] == home
    assert (again.stats()["warm_fired"], again.stats()["warm_skipped_resident"]) == (0, 1)
    other = one("conversation-2")
    assert other._parts.last_facts.homes["slow"] != home and other.stats()["warm_fired"] == 1
    warmed = {s.api_base for s in evented_pool["servers"] if any(r.body.get("max_tokens") == 1 for r in chats(s))}
    assert warmed == {home, other._parts.last_facts.homes["slow"]}
    skipped = [e for e in events if e["event"] == "warm_skipped_resident"]
    assert [e["replica"] for e in skipped] == [home]
    for s in (first, again, other):
        s.close()


def test_user_is_an_opt_in_and_a_callers_user_wins():
    """``affinity_user=True`` sends the key as ``user`` too (unless the caller set one); by default only the header;
    ``affinity_headers=()`` sends no header."""
    from agentkv.testing import FakeHttp, models_answer

    class Client:
        def __init__(self):
            self.calls = []

        def completion(self, **kwargs):
            self.calls.append(kwargs)
            return {"choices": [{"message": {"role": "assistant", "content": "ok"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1}}

    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    sent = {}
    for name, options in (("default", {}), ("user", {"affinity_user": True}), ("none", {"affinity_headers": ()})):
        client = Client()
        fast = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", name="fast", **options)
        with Session(fast, client=client, http=http, discovery=WindowDiscovery(http=http), count_with_server=False) as s:
            s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="theirs")
        sent[name] = [(c.get("extra_headers"), c.get("user")) for c in client.calls]
        key = s.routing_key
        if name == "default":
            assert sent[name] == [({"X-Session-ID": key}, None), ({"X-Session-ID": key}, "theirs")]
        elif name == "user":
            assert sent[name] == [({"X-Session-ID": key}, key), ({"X-Session-ID": key}, "theirs")]
        else:
            assert sent[name] == [(None, None), (None, "theirs")]


def test_recover_for_a_caller_that_sends_itself_visits_each_replica_once_then_fails_over():
    """``Session.recover`` after outages on a slow pool moves the try to each replica once (each ejected), then to
    fast; it never loops between two."""
    import httpx

    from agentkv.errors import PoolExhaustedError
    from agentkv.testing import FakeHttp, models_answer

    http = FakeHttp(lambda method, url, body: models_answer("fast" if ":9/" in url else "slow",
                                                            1000 if ":9/" in url else 100_000))
    fast = Backend("hosted_vllm/fast", api_base="http://127.0.0.1:9/v1", name="fast")
    slow = Backend("hosted_vllm/slow", api_base=[f"http://127.0.0.1:{p}/v1" for p in (11, 12, 13)], name="slow")
    with Session(fast, slow, http=http, discovery=WindowDiscovery(http=http), count_with_server=False,
                 state=InProcessStore()) as s:
        attempt = s.prepare({"messages": [{"role": "user", "content": "word " * 900}], "max_tokens": 4})
        visited = []
        while attempt.decision.role == "slow" and len(visited) < 10:
            visited.append(attempt.backend.api_base)
            error = httpx.ConnectError("refused")
            try:
                attempt = s.recover(attempt, error)
            except PoolExhaustedError as exhausted:  # fast cannot hold it either: the pool's exhaustion ends the turn
                assert isinstance(exhausted.__cause__, httpx.ConnectError)
                break
        assert sorted(visited) == sorted(slow.replicas)
        assert s.stats()["replica_failovers"] == 2 and s._parts.ejections.down(slow.replicas) == set(slow.replicas)


def test_a_pool_replica_retries_what_it_would_not_fail_over():
    """With outages off (a pool's replica), a refused connection is not retried on it, but a read timeout (which does
    not fail over by default) is, as on one server."""
    import httpx

    from agentkv import RetryPolicy

    policy = RetryPolicy()
    for error, tries in ((httpx.ConnectError("refused"), 1), (httpx.ReadTimeout("slow"), 3)):
        taken = 1
        while policy.retry_after(error, tries=taken, limit=policy.limit(), outages=False) is not None:
            taken += 1
        assert taken == tries, type(error).__name__


def test_a_later_mark_never_shortens_a_replicas_cool_off(redis_url):
    """A second, shorter mark leaves the first one's end, in Redis and in process."""
    import time

    from agentkv.state import RedisStore

    for store in (RedisStore.from_url(redis_url, namespace=f"fleet-{uuid.uuid4()}", timeout_s=1.0), InProcessStore()):
        store.mark_down("http://b/v1", 5)
        store.mark_down("http://b/v1", 0.1)
        time.sleep(0.2)
        assert store.read_down(["http://b/v1"]) == {"http://b/v1"}, type(store).__name__


def test_chat_agentkv_refuses_a_pool_it_cannot_address():
    """ChatAgentKV's LangChain models each address one URL: a Session over a pool is refused, naming the fix."""
    from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel

    from agentkv.errors import ConfigurationError
    from agentkv.integrations.langchain import ChatAgentKV

    fast = Backend("hosted_vllm/fast", api_base="http://127.0.0.1:9/v1", name="fast")
    slow = Backend("hosted_vllm/slow", api_base=["http://127.0.0.1:11/v1", "http://127.0.0.1:12/v1"], name="slow")
    model = FakeMessagesListChatModel(responses=[])
    with Session(fast, slow) as s, pytest.raises(ConfigurationError, match="router"):
        ChatAgentKV(model, model, s)
