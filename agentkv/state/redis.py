"""The fleet's store: cooldowns, in-flight leases, windows and homes shared through Redis (redis-py).

Every claim is one Lua script (atomic on the server, one round trip); every key lives under
``agentkv:{<namespace>}:`` (the braces keep a deployment's keys in one Redis Cluster slot, so a
script may touch several of them). Tenants, sessions, pools and replicas appear only as opaque ids,
keyed by the cache-salt secret when one is set (:func:`~agentkv.fleet.store_id`): no replica's URL,
no tenant's name, nothing of a prompt is stored. A conversation's home is one script call whatever
the pool's size (per-replica counts, never a scan of the homes), and survives Redis being away
(this process's copy, :class:`~agentkv.state.memory.RecentHomes`). Each call is bounded by
``timeout_s`` (50 ms by default) and, once one has failed, calls fail fast (:class:`StateUnavailable`)
for ``retry_s`` before the store tries again: a Redis that is down or slow costs a request at most
one timeout per ``retry_s``.

    store = RedisStore.from_url("redis://cache:6379/0", namespace="prod")
    Session(fast, slow, state=store)          # or agentkv.configure(state=store), or AGENTKV_REDIS_URL
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Collection, Sequence, TypeVar

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

import agentkv._support.env as _env
from agentkv.events import emit
from agentkv.fleet.rendezvous import HOME_MAX_ACTIVE, HOME_TENANT_SHARE, first_up, store_id, tenant_cap
from agentkv.state.memory import FORGET_PER_CALL, RecentHomes
from agentkv.state.protocol import checked_home_bounds, ClaimOutcome, Lease, SharedWindow, StateUnavailable, WarmClaim

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 0.05

# KEYS: the tenant's cooldown map, the deployment's leases. ARGV: session digest, cooldown ms,
# max sessions, slot limit, lease token, lease ms. Scores are expiry times on the server's clock.
CLAIM_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 'cooldown' end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return 'saturated' end
local lease_ms = tonumber(ARGV[6])
redis.call('ZADD', KEYS[2], now + lease_ms, ARGV[5])
if redis.call('PTTL', KEYS[2]) < lease_ms then redis.call('PEXPIRE', KEYS[2], lease_ms) end
local cooldown_ms = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + cooldown_ms, ARGV[1])
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[3])
if over > 0 then redis.call('ZPOPMIN', KEYS[1], over) end
redis.call('PEXPIRE', KEYS[1], cooldown_ms)
return 'fire'
"""


# KEYS: the pool's homes (hash: conversation -> "replica tenant"), its activity (zset: conversation -> last seen ms),
# its counts (hash: "r:<replica>" and "t:<tenant>" -> active conversations).
# ARGV: conversation, tenant, the home this process last saw ("" when none: it re-seeds a store that lost the
# conversation), idle ms, slack, the bound, the tenant's share of it, how many idle conversations to forget at most,
# then the ranked replicas, each followed by "1" when down. Every value is an opaque id. Nothing here reads every
# home: each command touches one entry, one replica's count, or at most ARGV[8] idle conversations.
HOME_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local conv, tenant, hint, idle = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local function count(field, delta)
  if redis.call('HINCRBY', KEYS[3], field, delta) <= 0 then redis.call('HDEL', KEYS[3], field) end
end
local function split(v)
  local sp = string.find(v, ' ', 1, true) or (#v + 1)
  return string.sub(v, 1, sp - 1), string.sub(v, sp + 1)
end
local function forget(c)
  local v = redis.call('HGET', KEYS[1], c)
  redis.call('HDEL', KEYS[1], c)
  redis.call('ZREM', KEYS[2], c)
  if v then
    local home, owner = split(v)
    count('r:' .. home, -1)
    count('t:' .. owner, -1)
  end
end
for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - idle, 'LIMIT', 0, tonumber(ARGV[8]))) do
  forget(c)
end
local ranked, down, known = {}, {}, {}
for i = 9, #ARGV, 2 do
  ranked[#ranked + 1] = ARGV[i]
  down[ARGV[i]] = ARGV[i + 1] == '1'
  known[ARGV[i]] = true
end
local function refreshed(home)
  redis.call('ZADD', KEYS[2], now, conv)
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], idle) end
  return home
end
local found = redis.call('HGET', KEYS[1], conv)
if found then
  local home = split(found)
  if known[home] then return refreshed(home) end
  forget(conv)
end
local up = {}
for _, r in ipairs(ranked) do if not down[r] then up[#up + 1] = r end end
if #up == 0 then up = ranked end
local full = redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[6])
  or tonumber(redis.call('HGET', KEYS[3], 't:' .. tenant) or '0') >= tonumber(ARGV[7])
if full then return up[1] end
local home = nil
if hint ~= '' and known[hint] then
  home = hint
else
  local fields = {}
  for i, r in ipairs(up) do fields[i] = 'r:' .. r end
  local counts, total = redis.call('HMGET', KEYS[3], unpack(fields)), 0
  for i = 1, #up do counts[i] = math.max(0, tonumber(counts[i] or '0')); total = total + counts[i] end
  local cap = math.ceil(tonumber(ARGV[5]) * (total + 1) / #up)
  for i, r in ipairs(up) do if home == nil and counts[i] < cap then home = r end end
  if home == nil then home = up[1] end
end
redis.call('HSET', KEYS[1], conv, home .. ' ' .. tenant)
count('r:' .. home, 1)
count('t:' .. tenant, 1)
return refreshed(home)
"""


class KeyLayout:
    """Every key a :class:`RedisStore` writes, under one deployment's namespace. Tenants, sessions, backends,
    pools and replicas appear only as opaque ids (:func:`~agentkv.fleet.store_id`), keyed by ``secret`` or else
    by ``AGENTKV_CACHE_SALT_SECRET`` (read at each call), the secret Sessions derive their cache salts from."""

    def __init__(self, namespace: str, secret: str | bytes | None = None) -> None:
        self.prefix = f"agentkv:{{{namespace}}}"
        self._secret = secret

    def adopt(self, secret: str | bytes) -> None:
        """Key every id by ``secret`` from now on, unless this layout was given a secret (or adopted one) already: a
        Session's own ``cache_salt_secret`` keys the store it is handed that has none (every Session of a deployment
        shares one secret, so the first to come is everyone's)."""
        if not self._secret and secret:
            self._secret = secret

    def id(self, kind: str, value: str) -> str:
        """The opaque id of ``value`` (of ``kind``: "tenant", "session", "replica", ...) in this store."""
        return store_id(kind, value, self._secret or _env.cache_salt_secret())

    def cooldowns(self, tenant: str) -> str:
        return f"{self.prefix}:cooldown:{self.id('tenant', tenant)}"

    def leases(self) -> str:
        return f"{self.prefix}:inflight"

    def window(self, key: str) -> str:
        return f"{self.prefix}:window:{self.id('backend', key)}"

    def correction(self, key: str) -> str:
        return f"{self.prefix}:correction:{self.id('backend', key)}"

    def down(self, key: str) -> str:
        return f"{self.prefix}:down:{self.id('replica', key)}"

    def homes(self, pool: str) -> str:
        return f"{self.prefix}:homes:{self.id('pool', pool)}"

    def seen(self, pool: str) -> str:
        return f"{self.prefix}:seen:{self.id('pool', pool)}"

    def counts(self, pool: str) -> str:
        return f"{self.prefix}:active:{self.id('pool', pool)}"


@dataclass(frozen=True)
class _HomeAsk:
    """One placement: the script's keys and arguments, and what maps its answer (a replica's id) back to a URL."""

    keys: list[str]
    args: list[Any]
    replicas: dict[str, str]  # id -> URL
    pool: str
    conversation: str
    fallback: str  # the answer while the store is away (this process's last home, else rendezvous alone)


class _Breaker:
    """After a failure, calls fail fast for ``retry_s``; then one is let through to try again."""

    def __init__(self, retry_s: float, clock: Callable[[], float]) -> None:
        self._retry_s, self._clock = retry_s, clock
        self._open_until: float | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        with self._lock:
            if self._open_until is not None and self._clock() < self._open_until:
                raise StateUnavailable("shared state store backing off after a failure")

    def failed(self, exc: BaseException) -> StateUnavailable:
        with self._lock:
            first = self._open_until is None
            self._open_until = self._clock() + self._retry_s
        emit("state_unavailable", level="warning" if first else "debug", error=type(exc).__name__)
        return StateUnavailable(type(exc).__name__)

    def succeeded(self) -> None:
        with self._lock:
            recovered, self._open_until = self._open_until is not None, None
        if recovered:
            emit("state_recovered")


_FAILURES = (redis.RedisError, OSError, asyncio.TimeoutError)


class RedisStore:
    """A :class:`~agentkv.state.StateStore` on Redis: a sync client for sync drivers, an asyncio
    client per event loop for async ones. ``timeout_s`` bounds every call; ``retry_s`` is how long
    calls fail fast after a failure (then the store reconnects by itself).

    ``secret`` keys every id in Redis (default: the ``cache_salt_secret`` of the first Session handed this store,
    else ``AGENTKV_CACHE_SALT_SECRET``). Homes: at most ``max_active``
    active conversations per pool, a tenant at most ``tenant_share`` of them (past either, rendezvous alone); the
    last ``recent_homes`` homes this process saw are kept here too, answered while Redis is away and re-seeded
    into it when it comes back empty."""

    def __init__(self, url: str, *, namespace: str = "default", timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic, secret: str | bytes | None = None,
                 max_active: int = HOME_MAX_ACTIVE, tenant_share: float = HOME_TENANT_SHARE,
                 recent_homes: int = 100_000) -> None:
        self.url, self.namespace, self.timeout_s = url, namespace, timeout_s
        self.keys = KeyLayout(namespace, secret)
        self.max_active, self.tenant_share = checked_home_bounds(max_active, tenant_share)
        self._recent = RecentHomes(recent_homes, clock=clock)
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                                   "decode_responses": True}
        self._options = options
        self.client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
        self._script = self.client.register_script(CLAIM_SCRIPT)
        self._home_script = self.client.register_script(HOME_SCRIPT)
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        self._breaker = _Breaker(retry_s, clock)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "RedisStore":
        """A store for ``redis://host:port/db`` (``rediss://`` for TLS); options as in the constructor."""
        return cls(url, **options)

    # ------------------------------------------------------------------ the two clients
    def async_client(self) -> Any:
        """The asyncio client of the running event loop (connections belong to one loop)."""
        loop = asyncio.get_running_loop()
        pair = self._async.get(loop)
        if pair is None:
            client = aredis.Redis.from_url(self.url, retry=AsyncRetry(NoBackoff(), 0), **self._options)
            pair = self._async[loop] = (client, client.register_script(CLAIM_SCRIPT),
                                        client.register_script(HOME_SCRIPT))
        return pair[0]

    def _async_script(self) -> Any:
        self.async_client()
        return self._async[asyncio.get_running_loop()][1]

    def _call(self, fn: Callable[[], T]) -> T:
        self._breaker.check()
        try:
            result = fn()
        except _FAILURES as exc:
            raise self._breaker.failed(exc) from exc
        self._breaker.succeeded()
        return result

    async def _acall(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        self._breaker.check()
        try:
            result = await asyncio.wait_for(fn(self.async_client()), self.timeout_s)
        except _FAILURES as exc:
            raise self._breaker.failed(exc) from exc
        self._breaker.succeeded()
        return result

    # ------------------------------------------------------------------ warm claims
    def _claim_args(self, claim: WarmClaim) -> tuple[list[str], list[Any], Lease]:
        lease = Lease(uuid.uuid4().hex, claim.limit)
        keys = [self.keys.cooldowns(claim.tenant), self.keys.leases()]
        args = [self.keys.id("session", claim.session_id), _ms(claim.cooldown_s), claim.max_sessions, claim.limit, lease.token,
                _ms(claim.lease_s)]
        return keys, args, lease

    def claim(self, claim: WarmClaim) -> tuple[ClaimOutcome, Lease | None]:
        keys, args, lease = self._claim_args(claim)
        outcome = self._call(lambda: self._script(keys=keys, args=args))
        return _granted(outcome, lease)

    async def aclaim(self, claim: WarmClaim) -> tuple[ClaimOutcome, Lease | None]:
        keys, args, lease = self._claim_args(claim)
        script = self._async_script()
        outcome = await self._acall(lambda c: script(keys=keys, args=args))
        return _granted(outcome, lease)

    def release(self, lease: Lease) -> None:
        self._call(lambda: self.client.zrem(self.keys.leases(), lease.token))

    async def arelease(self, lease: Lease) -> None:
        await self._acall(lambda c: c.zrem(self.keys.leases(), lease.token))

    # ------------------------------------------------------------------ windows
    def read_window(self, key: str) -> SharedWindow | None:
        return _shared_window(self._call(lambda: self.client.mget(self._window_keys(key))))

    async def aread_window(self, key: str) -> SharedWindow | None:
        return _shared_window(await self._acall(lambda c: c.mget(self._window_keys(key))))

    def write_window(self, key: str, window: SharedWindow, ttl_s: float) -> None:
        writes = self._window_writes(key, window, ttl_s)
        self._call(lambda: _pipelined(self.client.pipeline(transaction=False), writes).execute())

    async def awrite_window(self, key: str, window: SharedWindow, ttl_s: float) -> None:
        writes = self._window_writes(key, window, ttl_s)
        await self._acall(lambda c: _pipelined(c.pipeline(transaction=False), writes).execute())

    def _window_keys(self, key: str) -> list[str]:
        return [self.keys.window(key), self.keys.correction(key)]

    def _window_writes(self, key: str, window: SharedWindow, ttl_s: float) -> list[tuple[str, str, int]]:
        writes = []
        if window.window is not None or window.model_listed is not None:
            listed = "" if window.model_listed is None else str(int(window.model_listed))
            writes.append((self.keys.window(key), f"{window.window or ''}|{listed}", _ms(ttl_s)))
        if window.correction is not None:
            writes.append((self.keys.correction(key), str(window.correction), _ms(ttl_s)))
        return writes

    # ------------------------------------------------------------------ replicas cooling off
    def mark_down(self, key: str, ttl_s: float) -> None:
        """A new mark, or a later end for one already there (never an earlier one: ``PEXPIRE … GT``)."""
        down, ms = self.keys.down(key), _ms(ttl_s)
        self._call(lambda: _marked(self.client.pipeline(transaction=True), down, ms).execute())

    async def amark_down(self, key: str, ttl_s: float) -> None:
        down, ms = self.keys.down(key), _ms(ttl_s)
        await self._acall(lambda c: _marked(c.pipeline(transaction=True), down, ms).execute())

    def read_down(self, keys: Sequence[str]) -> frozenset[str]:
        if not keys:
            return frozenset()
        values = self._call(lambda: self.client.mget([self.keys.down(key) for key in keys]))
        return frozenset(key for key, value in zip(keys, values) if value)

    async def aread_down(self, keys: Sequence[str]) -> frozenset[str]:
        if not keys:
            return frozenset()
        values = await self._acall(lambda c: c.mget([self.keys.down(key) for key in keys]))
        return frozenset(key for key, value in zip(keys, values) if value)

    # ------------------------------------------------------------------ a pool's conversations
    def _home_ask(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], slack: float,
                  idle_s: float, tenant: str) -> _HomeAsk:
        ids = {self.keys.id("replica", url): url for url in ranked}
        last = self._recent.get(pool, conversation, idle_s)
        args: list[Any] = [self.keys.id("conversation", conversation), self.keys.id("tenant", tenant),
                           "" if last is None else self.keys.id("replica", last), _ms(idle_s), repr(float(slack)),
                           self.max_active, tenant_cap(self.max_active, self.tenant_share, tenant), FORGET_PER_CALL]
        for replica_id, url in ids.items():
            args += [replica_id, "1" if url in down else "0"]
        keys = [self.keys.homes(pool), self.keys.seen(pool), self.keys.counts(pool)]
        fallback = last if last is not None and last in ranked else first_up(ranked, down)
        return _HomeAsk(keys, args, ids, pool, conversation, fallback)

    def _settled(self, ask: _HomeAsk, answer: Any) -> str:
        """The URL the store answered (its id mapped back), else the fallback; remembered as this process's copy."""
        home = ask.replicas.get(str(answer), ask.fallback) if answer is not None else ask.fallback
        self._recent.put(ask.pool, ask.conversation, home)
        return home

    def home_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                     slack: float, idle_s: float, tenant: str = "") -> str:
        """As the Protocol says, in one script call; while Redis is away (never raises), the home this process last
        saw for the conversation, else its first replica up."""
        ask = self._home_ask(pool, conversation, ranked, down, slack, idle_s, tenant)
        try:
            answer = self._call(lambda: self._home_script(keys=ask.keys, args=ask.args))
        except StateUnavailable:
            answer = None
        return self._settled(ask, answer)

    async def ahome_replica(self, pool: str, conversation: str, ranked: Sequence[str], down: Collection[str], *,
                            slack: float, idle_s: float, tenant: str = "") -> str:
        ask = self._home_ask(pool, conversation, ranked, down, slack, idle_s, tenant)
        self.async_client()
        script = self._async[asyncio.get_running_loop()][2]
        try:
            answer = await self._acall(lambda c: script(keys=ask.keys, args=ask.args))
        except StateUnavailable:
            answer = None
        return self._settled(ask, answer)

    def close(self) -> None:
        """Close the sync client's connections (asyncio clients close with their loops)."""
        self.client.close()


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _granted(outcome: str, lease: Lease) -> tuple[ClaimOutcome, Lease | None]:
    if outcome == "fire":
        return "fire", lease
    return ("saturated" if outcome == "saturated" else "cooldown"), None


def _marked(pipe: Any, key: str, ms: int) -> Any:
    """``pipe`` with a down mark queued: set when absent, else made to end later (``PEXPIRE … GT``), never earlier."""
    pipe.set(key, "1", px=ms, nx=True)
    pipe.pexpire(key, ms, gt=True)
    return pipe


def _pipelined(pipe: Any, writes: list[tuple[str, str, int]]) -> Any:
    for key, value, ttl_ms in writes:
        pipe.set(key, value, px=ttl_ms)
    return pipe


def _int_or_none(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) > 0 else None


def _shared_window(values: list[Any]) -> SharedWindow:
    info, correction = values
    window, listed = (info.split("|", 1) if info and "|" in info else ("", ""))
    return SharedWindow(_int_or_none(window), bool(int(listed)) if listed in ("0", "1") else None,
                        _int_or_none(correction or ""))
