"""Gemini explicit caches are owned by their creator (issue 37, finding 11), through litellm's real Gemini provider
code against the Gemini fake on 127.0.0.1: a Session learns the name of each cache its requests create, tenants never
share one, a close deletes only caches no other Session of the process still holds, and a cache gone mid-request
never fails a turn."""

import asyncio
import copy

import httpx
import pytest

from agentkv import Backend, Session
from agentkv.state import InProcessStore
from agentkv.warm import CooldownMap
from agentkv.testing.providers.gemini import FakeGemini
from agentkv.testing import capture_events

KEY = "g-test"


def chat(turns):
    """A growing chat whose every request ends on a user message (what a Gemini explicit cache can end on)."""
    msgs = [{"role": "system", "content": "You are an incident analyst. " * 20}]
    history = []
    for t in range(turns):
        words = " ".join(f"service-{t}-{i} latency p99 rose" for i in range(25))
        msgs = msgs + [{"role": "user", "content": f"Question {t}: {words}"}]
        history.append(copy.deepcopy(msgs))
        msgs = msgs + [{"role": "assistant", "content": f"Answer {t}: checked."}]
    return history


def backends(fresh, fake):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend("gemini/gemini-2.5-flash", api_base=fake.url, api_key=KEY, name="slow", explicit_cache=True)
    return fast, slow


def named(bodies):
    """The cachedContents names the generateContent bodies named."""
    return {b.get("cachedContent") or b.get("cached_content") for b in bodies} - {None}


def creates(fake):
    return [c for c in fake.calls if c.method == "POST" and c.path.endswith("/cachedContents")]


def to_first_slow_turn(session, fake, history):
    """Send ``history`` until one turn went to slow (the warm drained before each next turn); the index of the next
    request and the cache names this Session's requests named."""
    sent = len(fake.requests)
    for at, msgs in enumerate(history):
        session.completion(messages=msgs, max_tokens=2)
        assert session.drain_warms(30)
        if session.last_route.role == "slow":
            return at + 1, named(fake.requests[sent:])
    raise AssertionError("no turn went to slow")


def one_slow_turn(session, fake, msgs):
    """One more slow turn: what it named, the caches created while it ran, and its ledger row."""
    sent, created = len(fake.requests), len(creates(fake))
    session.completion(messages=msgs, max_tokens=2)
    assert session.last_route.role == "slow"
    return named(fake.requests[sent:]), creates(fake)[created:], session.ledger[-1]


def two_tenants(fresh, fake, history):
    """Tenant A, then tenant B, each warmed and escalated once on the same prefix with the same API key."""
    fast, slow = backends(fresh, fake)
    a = Session(fast, slow, tenant="acme")
    b = Session(fast, slow, tenant="globex")
    _, a_named = to_first_slow_turn(a, fake, history)
    at, b_named = to_first_slow_turn(b, fake, history)
    return a, b, at, a_named, b_named


def test_closing_one_tenants_session_leaves_the_cache_another_tenant_created(fresh):
    """Two tenants on one prefix each create and read their own cache (B never names A's), and A's close deletes A's
    only: B's stays live."""
    with FakeGemini() as fake:
        history = chat(20)
        a, b, _, a_named, b_named = two_tenants(fresh, fake, history)
        assert a_named and b_named and a_named.isdisjoint(b_named)
        a.close()
        assert a.drain_warms(30)
        live = {c.name for c in fake.caches()}
        assert b_named <= live and a_named.isdisjoint(live)
        b.close()
        assert b.drain_warms(30) and fake.caches() == []


def test_two_tenants_warming_one_prefix_at_once_each_own_the_cache_they_created(fresh):
    """Tenants A and B send the same conversation turn by turn, so their warms run at the same moment: each creates
    its own cache, and after A's close B's next slow turn still reads B's, creating none."""
    with FakeGemini() as fake:
        history = chat(20)
        fast, slow = backends(fresh, fake)
        a, b = Session(fast, slow, tenant="acme"), Session(fast, slow, tenant="globex")
        at = 0
        while a.last_route is None or a.last_route.role != "slow" or b.last_route.role != "slow":
            a.completion(messages=history[at], max_tokens=2)
            b.completion(messages=history[at], max_tokens=2)
            at += 1
        assert a.drain_warms(30) and b.drain_warms(30) and len(creates(fake)) == 2
        a.close()
        assert a.drain_warms(30) and len(fake.caches()) == 1
        turn_named, created, row = one_slow_turn(b, fake, history[at])
        assert turn_named and turn_named <= {c.name for c in fake.caches()} and created == []
        assert row.cached_tokens > 1000
        b.close()
        assert b.drain_warms(30) and fake.caches() == []


def test_a_slow_turn_after_another_tenants_close_reads_its_own_cache(fresh):
    """After tenant A closes, tenant B's next slow turn names the cache B created and reads it, creating none."""
    with FakeGemini() as fake:
        history = chat(20)
        a, b, at, _, b_named = two_tenants(fresh, fake, history)
        a.close()
        assert a.drain_warms(30)
        turn_named, created, row = one_slow_turn(b, fake, history[at])
        assert turn_named and turn_named <= b_named and created == [] and row.cached_tokens > 1000
        b.close()


def test_a_close_racing_another_tenants_request_in_flight_neither_fails_nor_misses_it(fresh):
    """Tenant A closes while tenant B's slow turn is in flight (between B sending and Gemini reading it): B's turn is
    answered from B's cache, with no cache created on the way."""
    with FakeGemini() as fake:
        history = chat(20)
        a, b, at, _, b_named = two_tenants(fresh, fake, history)
        serve, raced = fake.server.handler, []

        def racing(call):
            if call.path.endswith(":generateContent") and not raced:
                raced.append(call)
                a.close()
                assert a.drain_warms(30)
            return serve(call)

        fake.server.handler = racing
        turn_named, created, row = one_slow_turn(b, fake, history[at])
        assert raced and turn_named <= b_named and created == [] and row.cached_tokens > 1000
        b.close()


def _distinct_ids(fast, slow):
    return Session(fast, slow, tenant="acme"), Session(fast, slow, tenant="acme")


def _one_session_id(fast, slow):
    """Two live Sessions sharing a session id (two Conversations objects, or a gateway beside one, name a conversation
    alike), each with its own guards (two services' stores), so each warms: they share nothing but the caches."""
    return tuple(Session(fast, slow, tenant="acme", session_id="same", state=InProcessStore(CooldownMap()))
                 for _ in range(2))


@pytest.mark.parametrize("pair", [_distinct_ids, _one_session_id], ids=["distinct ids", "one session id"])
def test_same_tenant_sessions_share_a_cache_deleted_only_when_the_last_one_closes(fresh, pair):
    """Two Sessions of one tenant in one process share the cache the first created, whatever their session ids; the
    first's close leaves it (the second still reads it, creating none) and the second's close deletes it."""
    with FakeGemini() as fake:
        history = chat(20)
        fast, slow = backends(fresh, fake)
        first, second = pair(fast, slow)
        _, first_named = to_first_slow_turn(first, fake, history)
        at, second_named = to_first_slow_turn(second, fake, history)
        assert second_named == first_named and len(creates(fake)) == 1
        first.close()
        assert first.drain_warms(30) and fake.deleted == []
        turn_named, created, row = one_slow_turn(second, fake, history[at])
        assert turn_named == first_named and created == [] and row.cached_tokens > 1000
        second.close()
        assert second.drain_warms(30) and fake.caches() == [] and set(fake.deleted) == first_named


def _deleting_before_the_next_turn(fake):
    """Make the fake delete every live cache (through its own API, as another client of the key would) just before
    it reads the next generateContent, so that it answers "CachedContent not found"."""
    serve, deleted = fake.server.handler, []

    def deleting(call):
        if call.path.endswith(":generateContent") and not deleted:
            for cache in fake.caches():
                answer = httpx.delete(f"{fake.url}/{cache.name}", headers={"x-goog-api-key": KEY})
                assert answer.status_code == 200
                deleted.append(cache.name)
        return serve(call)

    fake.server.handler = deleting
    return deleted


def test_a_cache_gone_under_a_slow_turn_is_retried_without_it(fresh):
    """Gemini answers "CachedContent not found" to a slow turn naming a cache deleted under it: the turn is sent again
    without the cache (the whole prompt inline, no cache created on the way) and answered, never failed."""
    with FakeGemini() as fake, capture_events() as events:
        history = chat(20)
        fast, slow = backends(fresh, fake)
        session = Session(fast, slow, tenant="acme")
        at, _ = to_first_slow_turn(session, fake, history)
        deleted = _deleting_before_the_next_turn(fake)
        sent = len(fake.requests)
        turn_named, created, row = one_slow_turn(session, fake, history[at])
        retried = fake.requests[sent:]
        assert deleted and turn_named == set(deleted) and created == []
        assert len(retried) == 2 and named(retried[1:]) == set() and row.backend == "slow"
        assert any(e["event"] == "explicit_cache_missing" for e in events)
        session.close()
        assert session.drain_warms(30)


def test_async_a_cache_gone_under_a_slow_turn_is_retried_without_it(fresh):
    """The async path retries a turn whose cache is gone the same way, and aclose deletes what the Session holds."""
    async def main(fake):
        history = chat(20)
        fast, slow = backends(fresh, fake)
        async with Session(fast, slow, tenant="acme") as session:
            at = 0
            while session.last_route is None or session.last_route.role != "slow":
                await session.acompletion(messages=history[at], max_tokens=2)
                await session.adrain_warms(30)
                at += 1
            deleted = _deleting_before_the_next_turn(fake)
            sent = len(fake.requests)
            await session.acompletion(messages=history[at], max_tokens=2)
            assert session.last_route.role == "slow" and deleted
            assert named(fake.requests[sent:sent + 1]) == set(deleted) and named(fake.requests[sent + 1:]) == set()
            await session.acompletion(messages=history[at + 1], max_tokens=2)  # a new cache for the next turns
        await session.adrain_warms(30)

    with FakeGemini() as fake:
        asyncio.run(main(fake))
        assert fake.caches() == []


class _CacheGone(Exception):
    """What litellm raises when Gemini answers a request naming a deleted cache."""

    status_code = 403

    def __init__(self):
        super().__init__('{"error": {"code": 403, "message": "CachedContent not found (or permission denied)"}}')


class _StreamingClient:
    """A completion client whose streamed answer is read lazily, as litellm's is: one naming a cache fails at its
    first read with Gemini's "CachedContent not found" (the Gemini fake does not stream)."""

    def __init__(self):
        self.calls = []

    def completion(self, **call):
        self.calls.append(call)
        return self._chunks(call)

    async def acompletion(self, **call):
        self.calls.append(call)
        return self._achunks(call)

    @staticmethod
    def _chunks(call):
        if call.get("cached_content"):
            raise _CacheGone()
        yield {"choices": [{"delta": {"content": "ok"}}]}

    @staticmethod
    async def _achunks(call):
        if call.get("cached_content"):
            raise _CacheGone()
        yield {"choices": [{"delta": {"content": "ok"}}]}


def test_a_streamed_turn_whose_cache_is_gone_is_sent_again_whole():
    """litellm sends a streamed request when the stream is first read: a first read saying the cache is gone sends
    the request again whole and reads that stream instead, sync and async, and the cache is forgotten."""
    from agentkv.providers.gemini import CacheRegistry, ExplicitCaches
    from agentkv.stats import SessionStats
    from agentkv.testing import FakeHttp
    from agentkv.wire.hosted import gemini_marked

    created = {"name": "cachedContents/gone", "expireTime": "2999-01-01T00:00:00Z",
               "usageMetadata": {"totalTokenCount": 2000}}
    slow = Backend("gemini/gemini-2.5-flash", api_base="http://127.0.0.1:9/v1beta", api_key=KEY, explicit_cache=True)
    msgs = chat(12)[-1]
    call = {**slow.litellm_kwargs(), **gemini_marked({"messages": msgs}, cache_end=len(msgs)), "stream": True}
    for asynchronous in (False, True):
        caches = ExplicitCaches("s", "acme", FakeHttp(lambda method, url, body: created), SessionStats(),
                                CacheRegistry())
        inner = _StreamingClient()
        client = caches.client(inner, [slow])
        if asynchronous:
            async def read(client):
                return [chunk async for chunk in await client.acompletion(**call)]
            chunks = asyncio.run(read(client))
        else:
            chunks = list(client.completion(**call))
        assert len(chunks) == 1 and [c.get("cached_content") for c in inner.calls] == ["cachedContents/gone", None]
        assert len(inner.calls[1]["messages"]) == len(msgs) and not caches


def test_the_wire_of_a_request_naming_its_cache():
    """A request naming a cache sends only the messages after it, and neither tools nor a tool choice beside it; one
    sent whole carries no marks; Gemini's and Vertex AI's "not found" answers name a missing cache, others do not."""
    from agentkv.wire.hosted import gemini_marked, gemini_named, gemini_unmarked, names_missing_cache

    msgs = chat(3)[-1]
    call = {"model": "gemini/gemini-2.5-flash", "tools": [{"type": "function"}], "tool_choice": "auto",
            **gemini_marked({"messages": msgs}, cache_end=len(msgs) - 1, ttl="600s")}
    named_call = gemini_named(call, msgs[-1:], "cachedContents/abc")
    assert named_call["messages"] == msgs[-1:] and named_call["cached_content"] == "cachedContents/abc"
    assert "tools" not in named_call and "tool_choice" not in named_call and "tools" in call
    whole = gemini_unmarked(call)
    assert "cache_control" not in str(whole["messages"]) and "cache_control" in str(call["messages"])
    assert names_missing_cache(403, '{"code": 403, "message": "CachedContent not found (or permission denied)"}')
    assert names_missing_cache(404, '"message": "Not found: cached content metadata for 42.", "status": "NOT_FOUND"')
    assert not names_missing_cache(400, "CachedContent can not be used with GenerateContent request setting tools")
    assert not names_missing_cache(403, "Permission denied on resource project.")


def test_a_cache_about_to_expire_is_not_named_again_and_the_last_holder_frees_it():
    """The registry names a cache only while it has more than the margin left before its expireTime, and frees it
    for deletion only when its last holder releases it."""
    from agentkv.providers.gemini import EXPIRY_MARGIN_S, CacheRegistry, OwnedCache

    now = [1_000_000.0]
    caches = CacheRegistry(clock=lambda: now[0])
    slow = Backend("gemini/gemini-2.5-flash", api_key=KEY, explicit_cache=True)
    caches.add(OwnedCache(slow, "cachedContents/a", "k", 2000, 0.0, 600.0, now[0] + 600, {}, {"one"}))
    assert caches.acquire("k", "two").name == "cachedContents/a"
    assert caches.release("one", ["cachedContents/a"]) == ([], 1)
    now[0] += 600 - EXPIRY_MARGIN_S
    assert caches.acquire("k", "three") is None
    free, kept = caches.release("two", ["cachedContents/a"])
    assert [c.name for c in free] == ["cachedContents/a"] and kept == 0 and caches.acquire("k", "four") is None
