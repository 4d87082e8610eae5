"""A Session's state, in one object: its backends and policies, the shared parts it uses (discovery, the state store,
the counters, the warm-ahead sender, the handoff) and what it keeps between requests (stats, the turn ledger, the
last route, the last two payloads). It has no behaviour beyond reading itself: what a request goes through is
functions over it (:mod:`agentkv._session.steps`, :mod:`agentkv._session.reactive`, :mod:`agentkv._session.outside`),
and :class:`~agentkv.Session` is this state with the public methods on top.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

import agentkv._env as _env
from agentkv._http import HttpTransport, default_http
from agentkv._session.attempts import LitellmSends
from agentkv._session.inputs import Facts, check_backends, check_timeout
from agentkv._session.record import Recorder
from agentkv.backends import Backend
from agentkv.discovery import WindowDiscovery, discovery_for
from agentkv.fleet import choose, pool_id, ranked, routing_key
from agentkv.handoff.escalation import Handoff
from agentkv.protocols import CompletionClient
from agentkv.retry import RetryPolicy
from agentkv.routing import RouteDecision, RoutePolicy
from agentkv.state import StateStore, ejections_for
from agentkv.state.config import resolve_state
from agentkv.stats import SessionStats
from agentkv._session.explicit_caches import ExplicitCaches
from agentkv.telemetry import tenant_digest
from agentkv.tenancy import keeps_caller_salt, resolve_cache_salt
from agentkv.tokens import Payload, TokenCounter
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy
from agentkv.warm.aware import SlowResidency
from agentkv.warm.sender import BackgroundJobs, WarmAhead

if TYPE_CHECKING:
    from agentkv.cache_ledger import CacheLedger

DEFAULT_REQUEST_TIMEOUT_S = 600.0

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "SessionState"]


class SessionState:
    """A Session's configuration and state (see :class:`~agentkv.Session` for the arguments)."""

    def __init__(
        self,
        fast: Backend,
        slow: Backend | None = None,
        *,
        tenant: str | None = None,
        session_id: str | None = None,
        routing: RoutePolicy = RoutePolicy(),
        warm_ahead: WarmAheadPolicy = WarmAheadPolicy(),
        retry: RetryPolicy = RetryPolicy(),
        discovery: WindowDiscovery | None = None,
        cooldowns: CooldownMap | None = None,
        in_flight: InFlightLimit | None = None,
        state: StateStore | None = None,
        cache_salt: str | bool | None = None,
        cache_salt_secret: str | None = None,
        request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
        client: CompletionClient | None = None,
        count_with_server: bool = True,
        http: HttpTransport | None = None,
        handoff: str | Handoff = "replay",
        mapper: Any = None,
        min_attention_cosine: float | None = None,
        count_exactly: bool = False,
        ledger: CacheLedger | None = None,
        clock: Callable[[], float] | None = None,
        ledger_rows: int | None = None,
    ) -> None:
        check_backends(fast, slow)
        self.fast, self.slow = fast, slow
        self.tenant = tenant
        self.session_id = session_id or str(uuid.uuid4())
        self.routing, self.warm_ahead, self.retry = routing, warm_ahead, retry
        self.state = resolve_state(state, cooldowns, in_flight)
        self.discovery = discovery or discovery_for(self.state)
        secret = cache_salt_secret or _env.cache_salt_secret()
        self.cache_salt = resolve_cache_salt(tenant, cache_salt, secret, self_hosted=any(b.self_hosted for b in self._backends()))
        self.routing_key = routing_key(tenant, self.session_id, secret)  # opaque: routers log headers
        self._tenant_digest = tenant_digest(tenant, secret)  # what spans carry for the tenant: keyed by the secret
        adopt = getattr(getattr(self.state, "keys", None), "adopt", None)  # a store with ids at rest (Redis)
        if secret and callable(adopt):
            adopt(secret)  # keys them by this secret unless it has one
        self.ejections = ejections_for(self.state)
        # each pool's replicas as Backends (label -> url -> replica), and every pooled URL (what ejections are read for)
        self.replicas = {b.label: {url: b.replica(url) for url in b.replicas} for b in self._backends() if b.is_pool}
        self.pooled = tuple(url for b in self._backends() for url in b.replicas)
        # each pool's name in the store and this conversation's order of its replicas (the key is fixed per Session)
        self.pool_ids = {b.label: pool_id(b.label, b.replicas) for b in self._backends() if b.is_pool}
        self.rankings = {b.label: ranked(self.routing_key, b.replicas) for b in self._backends() if b.is_pool}
        self.slow_prompt_tokens: int | None = None  # the last slow answer's prompt (what its next turn expects cached)
        self.crossed = False  # this conversation crossed the warm threshold (the cost gate's escalation tally)
        self.escalation_tallied = False
        self.cache_end: int | None = None  # messages the last hosted cache write covered (a warm's, a slow turn's)
        self.last_facts: Facts | None = None  # a pooled Session's last gathered facts (its homes, the replicas down)
        self.request_timeout_s = check_timeout(request_timeout_s)
        self.client: CompletionClient = client if client is not None else _env.LazyLitellm()
        self.http: HttpTransport = http or default_http()
        self.counters = {b.label: TokenCounter.for_backend(b, use_server=count_with_server, http=self.http,
                                                           estimate_first=not count_exactly)
                         for b in self._backends()}
        self.handoff = handoff if isinstance(handoff, Handoff) else Handoff(
            handoff, mapper, min_attention_cosine=min_attention_cosine)
        self._stats = SessionStats()
        self.last_route: RouteDecision | None = None
        self._history: list[Payload] = []
        self._jobs = BackgroundJobs()
        # the Gemini explicit caches its requests create or read: its client creates and names them, close releases them
        self.explicit_caches = ExplicitCaches(self.session_id, tenant, self.http, self._stats)
        self.client = self.explicit_caches.client(self.client, self._backends())
        self._warm = WarmAhead(warm_ahead, self.state, self._stats, self._jobs, session_id=self.session_id,
                               tenant=tenant, clock=clock or time.monotonic,
                               tenant_key=None if tenant is None else self._tenant_digest)
        self._warm.ejections, self._warm.cooloff_s = self.ejections, retry.replica_cooloff_s
        self._record = Recorder(self._stats, rows=ledger_rows, session=self.session_id, tenant=tenant)
        self._sends = LitellmSends()  # the tools as litellm sends them, rebuilt when the caller's change
        self.cache_ledger = ledger
        followed = [b for b in self._members(slow) if ledger.follows(b)] if ledger is not None and slow else []
        self.residency: SlowResidency | None = None  # event-aware warms' view of slow (a pool's: its replica, per turn)
        if ledger is not None and slow is not None and followed:
            self.residency = SlowResidency(ledger, followed[0], self.cache_salt, self._counter(slow))
            self._warm.attach(self.residency)
        self.closed = False

    def _backends(self) -> list[Backend]:
        return [b for b in (self.fast, self.slow) if b is not None]

    def _backend(self, role: str) -> Backend:
        return self.slow if role == "slow" and self.slow is not None else self.fast

    def _addressed(self, role: str, facts: Facts | None = None, avoid: frozenset[str] | set[str] = frozenset()) -> Backend:
        """The backend ``role`` names, addressed to this conversation's replica when it is a pool: its home
        (``facts.homes``; the last gathered facts when None) unless that is down (``facts.down``) or in ``avoid`` (found
        down this turn), else its first choice (:func:`~agentkv.fleet.choose`) that is neither."""
        backend = self._backend(role)
        if not backend.is_pool:
            return backend
        facts = facts or self.last_facts
        down = facts.down if facts is not None else frozenset()
        home = facts.homes.get(backend.label) if facts is not None else None
        if home is not None and home not in down and home not in avoid and home in backend.replicas:
            return self.replicas[backend.label][home]
        url = choose(self.routing_key, backend.replicas, down=down, tried=avoid) or choose(
            self.routing_key, backend.replicas)
        return self.replicas[backend.label][url or backend.replicas[0]]

    def _members(self, backend: Backend, down: frozenset[str] = frozenset()) -> list[Backend]:
        """What discovery asks for ``backend``'s window: each replica of a pool not ``down`` (all when every one is),
        else the backend."""
        if not backend.is_pool:
            return [backend]
        replicas = self.replicas[backend.label]
        return [r for url, r in replicas.items() if url not in down] or list(replicas.values())

    def _counter(self, backend: Backend) -> TokenCounter:
        return self.counters[backend.label]

    @property
    def _keeps_caller_salt(self) -> bool:
        return keeps_caller_salt(self.tenant, self.cache_salt)

    def _stamp(self) -> float | None:
        """The publishers' clock now (vLLM stamps event batches with ``time.time()``; the prediction reads the ledger
        as of it, whatever clock the ledger was given); None without a ledger."""
        return time.time() if self.cache_ledger is not None else None
