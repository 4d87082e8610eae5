"""Which replicas are cooling off after an outage: this process's own marks at once, every other process's through
the :class:`~agentkv.state.StateStore` (with :class:`~agentkv.state.RedisStore`, ejections are shared by every
process on that Redis).

A replica is marked for a cool-off on evidence that it is failing, not one request: what each try of a pooled replica
ended in (:func:`agentkv.retry.replica_evidence`) is fed to its circuit breaker (:mod:`agentkv.fleet.breaker`, pure),
and the breaker's verdict is carried out here; a health check that finds it down marks it too. Its conversations go to
their next replica meanwhile (:func:`agentkv.fleet.choose`). The breaker's records are this process's: conversations
and tenants are kept as digests under a key drawn at start, never written anywhere. The store is read
at most once per ``refresh_s`` per pool, so choosing a replica costs a dictionary lookup on most requests. A store
that does not answer leaves this process's own marks in force: an ejection is a guess, and a try tells.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref
from typing import Callable, Sequence

from agentkv.http.transport import redact_url
from agentkv.events import emit
from agentkv.fleet.breaker import BreakerRule, Evidence, ReplicaRecord, Verdict
from agentkv.state.protocol import StateStore, StateUnavailable

__all__ = ["DEFAULT_COOLOFF_S", "PROBE_EVERY_S", "Ejections", "ejections_for"]

DEFAULT_COOLOFF_S = 30.0
PROBE_EVERY_S = 5.0  # how often a process checks that a replica holding its conversations' warms is up
_RECORDS_LIMIT = 4096  # replicas whose breaker records a process keeps
_DIGEST_KEY = os.urandom(32)  # the breaker's digests are compared in this process only


def _digest(kind: bytes, value: str) -> str:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=12, key=_DIGEST_KEY,
                           person=kind).hexdigest()


class Ejections:
    """Replicas marked down, per ``store``. ``mark``/``amark`` eject one for ``cooloff_s``; ``down``/``adown`` say
    which of a pool's replicas are out now.

    What each try of a replica ended in is fed to :meth:`observe`/:meth:`aobserve`; the replica is ejected when its
    breaker (``rule``, :mod:`agentkv.fleet.breaker`) says so. A replica this process ejected stays out after its
    cool-off until a health check says it is up (:meth:`on_probation`, :meth:`confirm`; a circuit breaker's half-open
    state): traffic goes back to a replica that answers, not to one that is still dead."""

    def __init__(self, store: StateStore, *, refresh_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 rule: BreakerRule = BreakerRule()) -> None:
        self._store = weakref.ref(store)  # weak: ejections_for's map never keeps a store (and its connections) alive
        self.refresh_s, self._clock, self.rule = refresh_s, clock, rule
        self._own: dict[str, float] = {}  # replica -> when this process's own mark ends (kept until confirmed up)
        # (tenant digest, replica) -> when a mark that only this tenant's evidence earned ends: out for it alone
        self._scoped: dict[tuple[str, str], float] = {}
        self._records: dict[str, ReplicaRecord] = {}  # replica -> its breaker's record
        self._seen: dict[tuple[str, ...], tuple[float, frozenset[str]]] = {}  # pool -> (read at, down then)
        self._probed: dict[str, float] = {}  # replica -> when this process last checked it was up
        self._lock = threading.Lock()

    def probe_due(self, replica: str, every_s: float = PROBE_EVERY_S) -> bool:
        """Whether ``replica`` should be checked now (at most once per ``every_s`` per process); True claims it."""
        now = self._clock()
        with self._lock:
            if now - self._probed.get(replica, float("-inf")) < every_s:
                return False
            if len(self._probed) > 4096:
                self._probed.clear()
            self._probed[replica] = now
            return True

    @property
    def store(self) -> StateStore:
        store = self._store()
        if store is None:  # pragma: no cover - a Session holds its store for as long as it holds this
            raise StateUnavailable("the state store is gone")
        return store

    def _marked(self, replica: str, cooloff_s: float, why: str) -> bool:
        """Record this process's mark; True when it is news (the replica was not already out here)."""
        now = self._clock()
        with self._lock:
            fresh = self._own.get(replica, 0.0) <= now
            self._own[replica] = now + cooloff_s
            self._records.pop(replica, None)  # its streak is spent: after the cool-off, the count starts again
            self._seen.clear()  # the next read asks the store again
        if fresh:
            emit("replica_ejected", level="warning", replica=redact_url(replica), cooloff_s=cooloff_s, why=why)
        return fresh

    def _scoped_mark(self, replica: str, cooloff_s: float, why: str, tenant: str | None) -> None:
        """Eject ``replica`` for ``tenant``'s conversations alone (its own evidence, no other tenant's): every other
        tenant of this process keeps it."""
        key = (_digest(b"tenant", tenant or ""), replica)
        with self._lock:
            self._scoped.pop(key, None)
            self._scoped[key] = self._clock() + cooloff_s
            while len(self._scoped) > _RECORDS_LIMIT:
                self._scoped.pop(next(iter(self._scoped)))  # the oldest mark
            self._records.pop(replica, None)
        emit("replica_ejected", level="warning", replica=redact_url(replica), cooloff_s=cooloff_s, why=why,
             scope="tenant")

    def mark(self, replica: str, cooloff_s: float = DEFAULT_COOLOFF_S, *, shared: bool = True,
             why: str = "down", tenant: str | None = None) -> None:
        """Eject ``replica`` for ``cooloff_s``: when ``shared``, here at once and in the store (best effort); else for
        ``tenant``'s conversations alone (one tenant's evidence never ejects a replica for the others)."""
        if not shared:
            self._scoped_mark(replica, cooloff_s, why, tenant)
            return
        self._marked(replica, cooloff_s, why)
        try:
            self.store.mark_down(replica, cooloff_s)
        except StateUnavailable:
            pass

    async def amark(self, replica: str, cooloff_s: float = DEFAULT_COOLOFF_S, *, shared: bool = True,
                    why: str = "down", tenant: str | None = None) -> None:
        if not shared:
            self._scoped_mark(replica, cooloff_s, why, tenant)
            return
        self._marked(replica, cooloff_s, why)
        try:
            await self.store.amark_down(replica, cooloff_s)
        except StateUnavailable:
            pass

    def judge(self, replica: str, evidence: Evidence, *, session: str, tenant: str | None) -> Verdict:
        """Feed ``replica``'s breaker what a try of (``tenant``, ``session``)'s conversation ended in; its verdict
        (no I/O: :meth:`observe` carries an ejection out)."""
        conversation = _digest(b"conversation", f"{tenant or ''}\0{session}")
        now = self._clock()
        with self._lock:
            record = self._records.pop(replica, None) or ReplicaRecord()
            record, verdict = record.observe(conversation, _digest(b"tenant", tenant or ""), evidence, now, self.rule)
            if len(self._records) >= _RECORDS_LIMIT:
                self._records.pop(next(iter(self._records)))  # the least recently fed
            self._records[replica] = record
        return verdict

    def observe(self, replica: str, evidence: Evidence, *, session: str, tenant: str | None,
                cooloff_s: float = DEFAULT_COOLOFF_S) -> Verdict:
        """:meth:`judge`, then eject ``replica`` for ``cooloff_s`` when the verdict says so."""
        verdict = self.judge(replica, evidence, session=session, tenant=tenant)
        if verdict.eject:
            self.mark(replica, cooloff_s, shared=verdict.shared, why=verdict.why, tenant=tenant)
        return verdict

    async def aobserve(self, replica: str, evidence: Evidence, *, session: str, tenant: str | None,
                       cooloff_s: float = DEFAULT_COOLOFF_S) -> Verdict:
        verdict = self.judge(replica, evidence, session=session, tenant=tenant)
        if verdict.eject:
            await self.amark(replica, cooloff_s, shared=verdict.shared, why=verdict.why, tenant=tenant)
        return verdict

    def cooling_s(self, replica: str) -> float | None:
        """How long this process's own mark on ``replica`` has left (0 once on probation); None without one."""
        with self._lock:
            end = self._own.get(replica)
        return None if end is None else max(0.0, end - self._clock())

    def on_probation(self, pool: Sequence[str]) -> list[str]:
        """The replicas of ``pool`` this process ejected whose cool-off is over, not yet confirmed up."""
        now = self._clock()
        with self._lock:
            return [replica for replica in pool if replica in self._own and self._own[replica] <= now]

    def confirm(self, replica: str) -> None:
        """A health check found ``replica`` up: it takes traffic again."""
        with self._lock:
            if self._own.pop(replica, None) is not None:
                self._seen.clear()
        emit("replica_restored", replica=redact_url(replica))

    def _cached(self, pool: tuple[str, ...]) -> frozenset[str] | None:
        now = self._clock()
        with self._lock:
            seen = self._seen.get(pool)
            if seen is not None and now - seen[0] < self.refresh_s:
                return seen[1]
        return None

    def _remember(self, pool: tuple[str, ...], shared: frozenset[str]) -> frozenset[str]:
        now = self._clock()
        with self._lock:
            own = frozenset(replica for replica in pool if replica in self._own)  # out, or on probation
            down = own | shared
            if len(self._seen) > 1024:
                self._seen.clear()
            self._seen[pool] = (now, down)
        return down

    def down(self, pool: Sequence[str], tenant: str | None = None) -> frozenset[str]:
        """The replicas of ``pool`` that are out now for ``tenant``'s conversations (this process's marks, the
        store's as last read, and the marks only that tenant's own evidence earned)."""
        key = tuple(pool)
        cached = self._cached(key)
        if cached is None:
            try:
                shared = self.store.read_down(key)
            except StateUnavailable:
                shared = frozenset()
            cached = self._remember(key, shared)
        return cached | self._tenants_own(key, tenant)

    async def adown(self, pool: Sequence[str], tenant: str | None = None) -> frozenset[str]:
        key = tuple(pool)
        cached = self._cached(key)
        if cached is None:
            try:
                shared = await self.store.aread_down(key)
            except StateUnavailable:
                shared = frozenset()
            cached = self._remember(key, shared)
        return cached | self._tenants_own(key, tenant)

    def _tenants_own(self, pool: tuple[str, ...], tenant: str | None) -> frozenset[str]:
        """The replicas of ``pool`` out for ``tenant`` alone (marks that only its own evidence earned), unexpired."""
        if not self._scoped:
            return frozenset()
        who, now = _digest(b"tenant", tenant or ""), self._clock()
        with self._lock:
            return frozenset(r for r in pool if self._scoped.get((who, r), 0.0) > now)


_FOR_STORE: "weakref.WeakKeyDictionary[StateStore, Ejections]" = weakref.WeakKeyDictionary()
_FOR_STORE_LOCK = threading.Lock()


def ejections_for(store: StateStore) -> Ejections:
    """The process's one :class:`Ejections` over ``store`` (every Session on that store shares it)."""
    with _FOR_STORE_LOCK:
        found = _FOR_STORE.get(store)
        if found is None:
            found = _FOR_STORE[store] = Ejections(store)
        return found
