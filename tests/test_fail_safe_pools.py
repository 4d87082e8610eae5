"""Pools at scale (issue 37): a home placed in O(1) whatever the number of active conversations, one Redis command per
placement, a bounded store with a per-tenant share, homes that survive a Redis stop and restart, and nothing of a
replica's URL or a tenant's name at rest in Redis."""

import hashlib
import sys
import threading
import uuid

from agentkv.fleet import choose, pool_id, ranked
from agentkv.state import InProcessStore, StateUnavailable
from agentkv.testing import FakeClock
from agentkv.testing.servers import free_port, redis_server

REPLICAS = ("http://a/v1", "http://b/v1", "http://c/v1")
# commands that read a whole structure: none of them may run inside a placement
_READS_ALL = {"HGETALL", "HVALS", "HKEYS", "HSCAN", "KEYS", "SCAN", "SMEMBERS", "SSCAN", "ZSCAN", "LRANGE"}


def place(store, key, down=(), **kw):
    """What the Session asks the store (steps.facts): the conversation's home, else its first choice."""
    try:
        return store.home_replica("pool", key, ranked(key, REPLICAS), down, slack=1.0, idle_s=600, **kw)
    except StateUnavailable:
        return choose(key, REPLICAS, down=down)


def redis_store(url, **options):
    from agentkv.state import RedisStore

    return RedisStore.from_url(url, namespace=f"pools-{uuid.uuid4()}", timeout_s=1.0, **options)


# ----------------------------------------------------------------------------- O(1) placement

def _monitored(store, action):
    """The commands Redis ran for ``action`` (from this client, and from scripts it ran), in order."""
    import redis

    watcher = redis.Redis.from_url(store.url, decode_responses=True)
    seen = []
    marker = f"end-{uuid.uuid4()}"
    with watcher.monitor() as monitor:
        ready = threading.Event()

        def read():
            ready.set()
            while True:
                command = monitor.next_command()
                if marker in command["command"]:
                    return
                source = "lua" if command["client_type"] == "lua" else command["client_port"]
                seen.append((source, command["client_type"], command["command"]))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        ready.wait()
        store.client.ping()  # a command MONITOR has seen before the action starts
        action()
        watcher.echo(marker)
        reader.join(10)
    ping = next(i for i, c in enumerate(seen) if c[2].upper().startswith("PING"))
    calls = [c[2] for c in seen[ping + 1:] if c[0] == seen[ping][0]]  # from the store's connection, after its PING
    return calls, [c[2] for c in seen if c[0] == "lua"]


def _fill(store, count):
    for i in range(count):
        place(store, f"fill-{i}")


def _reads_everything(command):
    name, *args = command.split()
    upper = [a.upper() for a in args]
    if name.upper() in _READS_ALL:
        return True
    return name.upper().startswith(("ZRANGE", "ZREVRANGE")) and "LIMIT" not in upper


def test_a_redis_placement_is_one_command_and_reads_no_home(redis_url):
    """Placing a new conversation in a pool of 50 or 1,500 active ones is one command (one script call); inside it,
    nothing reads every home, and it runs as many commands at 1,500 as at 50."""
    inside = {}
    for active in (50, 1500):
        store = redis_store(redis_url)
        _fill(store, active)
        calls, lua = _monitored(store, lambda s=store: place(s, "new"))
        assert len(calls) == 1 and calls[0].split()[0].upper() in ("EVALSHA", "EVAL"), calls
        assert not [c for c in lua if _reads_everything(c)], lua
        inside[active] = len(lua)
        store.close()
    assert inside[1500] <= inside[50]


def _lines_run(action):
    """How many Python lines ``action`` runs (every frame it enters)."""
    lines = [0]

    def trace(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return trace

    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(None)
    return lines[0]


def test_an_in_process_placement_costs_the_same_at_any_active_count():
    """The in-process store places a new conversation in as many steps with 3,000 active conversations as with 30."""
    costs = {}
    for active in (30, 3000):
        store = InProcessStore(clock=FakeClock())
        _fill(store, active)
        costs[active] = _lines_run(lambda s=store: place(s, "new"))
    assert costs[3000] <= costs[30] + 5, costs


def test_the_active_bound_is_explicit_and_large():
    """The bound is at least a million active conversations per pool, with a tenant's share under all of it."""
    from agentkv.fleet import HOME_MAX_ACTIVE, HOME_TENANT_SHARE

    assert HOME_MAX_ACTIVE >= 1_000_000 and 0 < HOME_TENANT_SHARE < 1


def _one_tenant_cannot_fill_the_pool(store):
    minted = [f"mint-{i}" for i in range(40)]
    answers = {k: place(store, k, tenant="mallory") for k in minted}
    assert set(answers.values()) <= set(REPLICAS)
    last = minted[-1]
    assert answers[last] == ranked(last, REPLICAS)[0]  # past its share: plain rendezvous
    assert place(store, last, down={answers[last]}, tenant="mallory") != answers[last]  # and nothing was stored
    for i in range(10):  # another tenant's conversations still get homes that are kept
        key = f"bob-{i}"
        home = place(store, key, tenant="bob")
        assert place(store, key, down={home}, tenant="bob") == home


def test_one_tenant_minting_ids_cannot_push_the_in_process_store_past_its_bound():
    """Past its share of the bound, a tenant's new conversations are placed by rendezvous and not stored (never an
    error); another tenant's are still stored."""
    _one_tenant_cannot_fill_the_pool(InProcessStore(clock=FakeClock(), max_active=40, tenant_share=0.25))


def _no_tenant_holds_the_whole_bound(store):
    for i in range(39):  # a deployment that names no tenant: well past a tenant's share, every home is kept
        key = f"anon-{i}"
        home = place(store, key, tenant="")
        assert place(store, key, down={home}, tenant="") == home


def test_conversations_of_no_tenant_may_hold_the_whole_bound(redis_url):
    """Conversations of no tenant (a single-tenant deployment) are not held to one tenant's share: their homes are kept
    up to the pool's bound, in process and in Redis."""
    _no_tenant_holds_the_whole_bound(InProcessStore(clock=FakeClock(), max_active=40, tenant_share=0.25))
    store = redis_store(redis_url, max_active=40, tenant_share=0.25)
    _no_tenant_holds_the_whole_bound(store)
    store.close()


def test_one_tenant_minting_ids_cannot_push_redis_past_its_bound(redis_url):
    """The same bound and share through Redis."""
    store = redis_store(redis_url, max_active=40, tenant_share=0.25)
    _one_tenant_cannot_fill_the_pool(store)
    store.close()


def test_a_full_pool_degrades_to_rendezvous(redis_url):
    """Past the whole bound, a new conversation gets its first replica up, in process and through Redis."""
    for store in (InProcessStore(clock=FakeClock(), max_active=10, tenant_share=1.0),
                  redis_store(redis_url, max_active=10, tenant_share=1.0)):
        _fill(store, 10)
        fresh = uuid.uuid4().hex
        first = ranked(fresh, REPLICAS)
        assert place(store, fresh) == first[0]
        assert place(store, fresh, down={first[0]}) == first[1]


def _idle_ones_leave_the_counts(store, wait):
    """30 conversations homed on a and b (c down), then idle past ``idle_s`` while one other stays active: 30 new
    ones spread evenly over a, b and c, so the idle ones' counts were taken back."""
    def at(key, down=()):
        return store.home_replica("pool", key, ranked(key, REPLICAS), down, slack=1.0, idle_s=0.3)

    assert {at(f"old-{i}", down={"http://c/v1"}) for i in range(30)} == {"http://a/v1", "http://b/v1"}
    wait(0.2)
    at("keepalive")
    wait(0.2)
    homes = [at(f"new-{i}") for i in range(30)]
    counts = [homes.count(r) for r in REPLICAS]
    assert max(counts) - min(counts) <= 2, counts


def test_idle_conversations_leave_the_counts():
    """Forgetting an idle conversation takes it off its replica's count (in process)."""
    clock = FakeClock()
    _idle_ones_leave_the_counts(InProcessStore(clock=clock), clock.advance)


def test_idle_conversations_leave_the_counts_in_redis(redis_url):
    """The same through Redis (its clock: two waits of 0.2 s against an idle time of 0.3 s)."""
    import time

    store = redis_store(redis_url)
    _idle_ones_leave_the_counts(store, time.sleep)
    store.close()


# ----------------------------------------------------------------------------- homes through a Redis outage

def test_homes_survive_a_redis_stop_and_restart():
    """30 conversations keep their homes while Redis is down (this process's copy) and after it restarts empty (the
    copy re-seeds it): at least 29 of 30 each time, and another process then reads the same homes."""
    port, clock = free_port(), FakeClock()
    keys = [uuid.uuid4().hex for _ in range(30)]
    with redis_server(port) as url:
        store = redis_store(url, retry_s=1.0, clock=clock)
        namespace = store.namespace
        homes = {k: place(store, k) for k in keys}
        assert sorted(list(homes.values()).count(r) for r in REPLICAS) == [10, 10, 10]
    clock.advance(2)
    during = {k: place(store, k) for k in keys}
    assert sum(during[k] == homes[k] for k in keys) >= 29
    with redis_server(port) as url:
        for _ in range(5):  # a stale connection fails once, then the store reconnects
            clock.advance(2)
            try:
                store.read_down(list(REPLICAS))
                break
            except StateUnavailable:
                continue
        after = {k: place(store, k) for k in keys}
        assert sum(after[k] == homes[k] for k in keys) >= 29
        from agentkv.state import RedisStore

        other = RedisStore.from_url(url, namespace=namespace, timeout_s=1.0)
        assert sum(place(other, k) == homes[k] for k in keys) >= 29
        other.close()
    store.close()


async def test_the_async_twin_keeps_a_home_while_redis_is_down():
    """The asyncio path answers from the same local copy while Redis is away, and never raises."""
    port, clock = free_port(), FakeClock()
    keys = [uuid.uuid4().hex for _ in range(30)]
    with redis_server(port) as url:
        store = redis_store(url, retry_s=1.0, clock=clock)
        homes = {k: await store.ahome_replica("pool", k, ranked(k, REPLICAS), (), slack=1.0, idle_s=600) for k in keys}
    clock.advance(2)
    during = {k: await store.ahome_replica("pool", k, ranked(k, REPLICAS), (), slack=1.0, idle_s=600) for k in keys}
    assert during == homes


# ----------------------------------------------------------------------------- nothing of a URL or a tenant at rest

def _everything_in(store):
    """Every key of the store's namespace and every value in them, as one string."""
    client, found = store.client, []
    for key in client.scan_iter(f"{store.keys.prefix}:*"):
        kind = client.type(key)
        found.append(key)
        if kind == "string":
            found.append(client.get(key) or "")
        elif kind == "hash":
            found += [f"{f}={v}" for f, v in client.hgetall(key).items()]
        elif kind == "zset":
            found += client.zrange(key, 0, -1)
    return "\n".join(found)


def test_no_redis_key_or_value_holds_a_replicas_url_or_its_secrets(redis_url, monkeypatch):
    """After placements and a down mark on a replica whose URL carries a password and an api key, Redis holds neither:
    replicas are stored by an opaque id, keyed by the salt secret, and mapped back to their URL in process."""
    monkeypatch.setenv("AGENTKV_CACHE_SALT_SECRET", "pools-secret")
    replicas = ("http://u:pass@host/v1?api_key=SECRET", "http://v:pass@other/v1?api_key=SECRET")
    store = redis_store(redis_url)
    pool = pool_id("slow", replicas)
    homes = {store.home_replica(pool, k, ranked(k, replicas), (), slack=1.0, idle_s=60)
             for k in (uuid.uuid4().hex for _ in range(6))}
    assert homes == set(replicas)
    store.mark_down(replicas[0], 5)
    assert store.read_down(list(replicas)) == {replicas[0]}
    text = _everything_in(store)
    assert text and "pass" not in text and "SECRET" not in text and "host" not in text
    assert store.home_replica(pool, "c", ranked("c", replicas), (), slack=1.0, idle_s=60, tenant="acme") in replicas
    text = _everything_in(store)
    assert "pass" not in text and "SECRET" not in text and "acme" not in text
    monkeypatch.setenv("AGENTKV_CACHE_SALT_SECRET", "another-secret")
    assert store.keys.down(replicas[0]) not in text  # the id is keyed: another secret, another id
    store.close()


def test_the_cooldown_key_is_keyed_by_the_salt_secret(redis_url, monkeypatch):
    """With a salt secret, a dictionary of five tenant names matches no cooldown key (unkeyed SHA-256 or not)."""
    from agentkv.state import WarmClaim

    names = ["acme", "globex", "initech", "umbrella", "hooli"]
    unkeyed = redis_store(redis_url)
    monkeypatch.delenv("AGENTKV_CACHE_SALT_SECRET", raising=False)
    guesses = {hashlib.sha256(n.encode()).hexdigest()[:16] for n in names}
    guesses |= {unkeyed.keys.cooldowns(n).rsplit(":", 1)[1] for n in names}
    monkeypatch.setenv("AGENTKV_CACHE_SALT_SECRET", "pools-secret")
    store = redis_store(redis_url)
    assert store.claim(WarmClaim("globex", "s1", 60, 16, 4, 5))[0] == "fire"
    keys = list(store.client.scan_iter(f"{store.keys.prefix}:cooldown:*"))
    assert len(keys) == 1 and keys[0].rsplit(":", 1)[1] not in guesses
    assert not any(g in _everything_in(store) for g in guesses)
    store.close()
    unkeyed.close()



def test_a_sessions_own_secret_keys_its_tenant_in_redis(redis_url, monkeypatch):
    """A Session given cache_salt_secret= (no environment secret, a RedisStore with no secret of its own) claims its
    warm and places its conversation under its tenant's digest keyed by that secret: a dictionary of five names,
    hashed plainly or through the store's own ids, matches nothing in Redis after a turn that warmed a pool."""
    from agentkv import Backend, Session, WindowDiscovery
    from agentkv.telemetry import tenant_digest
    from agentkv.testing import FakeHttp, models_answer

    monkeypatch.delenv("AGENTKV_CACHE_SALT_SECRET", raising=False)
    names = ["acme", "globex", "initech", "umbrella", "hooli"]
    store = redis_store(redis_url)
    guesses = {hashlib.sha256(n.encode()).hexdigest()[:16] for n in names}
    guesses |= {store.keys.cooldowns(n).rsplit(":", 1)[1] for n in names}
    guesses |= {store.keys.cooldowns(tenant_digest(n)).rsplit(":", 1)[1] for n in names}
    answer = {"id": "c", "object": "chat.completion", "model": "m", "usage": {"prompt_tokens": 9, "completion_tokens": 1,
              "total_tokens": 10}, "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant", "content": "ok"}}]}

    def handler(method, url, body):
        return models_answer("m", 2048 if ":9101" in url else 16384) if method == "GET" else answer

    class Client:
        def completion(self, **kwargs):
            return answer

    fast = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9101/v1", name="fast", window=2048)
    slow = Backend("hosted_vllm/m", api_base=["http://127.0.0.1:9102/v1", "http://127.0.0.1:9103/v1"], name="slow",
                   window=16384)
    http = FakeHttp(handler)
    with Session(fast, slow, tenant="globex", session_id="s1", cache_salt_secret="session-secret", state=store,
                 client=Client(), http=http, discovery=WindowDiscovery(http=http), count_with_server=False) as s:
        s.completion(messages=[{"role": "user", "content": "check the disk latency graphs " * 260}], max_tokens=8)
        assert s.drain_warms(10)
        assert s.stats()["warm_fired"] == 1
    assert any(c.method == "POST" and ":910" in c.url for c in http.calls)  # the warm went to the slow pool
    text = _everything_in(store)
    assert ":cooldown:" in text or list(store.client.scan_iter(f"{store.keys.prefix}:cooldown:*"))
    assert text and not any(g in text for g in guesses) and "globex" not in text
    from agentkv.fleet import store_id

    unkeyed = {store_id("replica", url, None) for url in slow.replicas} | {store_id("pool", "slow", None)}
    assert not any(u in text for u in unkeyed)  # the replicas' ids too are keyed by the Session's secret
    store.close()
