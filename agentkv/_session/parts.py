"""What a Session is made of (:class:`SessionParts`): its backends and policies, the shared parts it uses (discovery,
the state store, the counters, the warm-ahead sender, the handoff) and what it keeps between requests (stats, the turn
ledger, the last route, the last two payloads). It has no behaviour beyond reading itself: a turn's steps read it
(:mod:`agentkv._session.turn`), and :class:`~agentkv.Session` holds one behind its public methods.
"""

from __future__ import annotations

import inspect
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypedDict, cast

import agentkv._support.env as _env
from agentkv.http.transport import HttpTransport, default_http
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
from agentkv.telemetry import tenant_digest
from agentkv._session.pipeline import Pipeline, Processor, TurnEvent
from agentkv._support.effects import Machine, Spawn
from agentkv.providers import SessionContext, SessionProviders
from agentkv.tenancy import keeps_caller_salt, resolve_cache_salt
from agentkv.tokens import Payload, TokenCounter
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy
from agentkv.warm.aware import SlowResidency
from agentkv._support.jobs import BackgroundJobs
from agentkv.warm.sender import WarmAhead

if TYPE_CHECKING:

    from agentkv.cache_ledger import CacheLedger

DEFAULT_REQUEST_TIMEOUT_S = 600.0
_CLOSE_TIMEOUT_S = 30.0  # releasing what a provider holds outside (a cache DELETE per cache)

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "SESSION_DEFAULTS", "SessionOptions", "SessionParts", "session_signature"]


class SessionOptions(TypedDict, total=False):
    """A Session's keyword arguments (see :class:`~agentkv.Session` for each one's meaning)."""

    tenant: str | None
    session_id: str | None
    routing: RoutePolicy
    warm_ahead: WarmAheadPolicy
    retry: RetryPolicy
    discovery: WindowDiscovery | None
    cooldowns: CooldownMap | None
    in_flight: InFlightLimit | None
    state: StateStore | None
    cache_salt: str | bool | None
    cache_salt_secret: str | None
    request_timeout_s: float | None
    client: CompletionClient | None
    count_with_server: bool
    http: HttpTransport | None
    handoff: str | Handoff
    mapper: Any
    min_attention_cosine: float | None
    count_exactly: bool
    cache_ledger: CacheLedger | None
    clock: Callable[[], float] | None
    ledger_rows: int | None


SESSION_DEFAULTS: dict[str, Any] = {
    "tenant": None, "session_id": None, "routing": RoutePolicy(), "warm_ahead": WarmAheadPolicy(),
    "retry": RetryPolicy(), "discovery": None, "cooldowns": None, "in_flight": None, "state": None, "cache_salt": None,
    "cache_salt_secret": None, "request_timeout_s": DEFAULT_REQUEST_TIMEOUT_S, "client": None,
    "count_with_server": True, "http": None, "handoff": "replay", "mapper": None, "min_attention_cosine": None,
    "count_exactly": False, "cache_ledger": None, "clock": None, "ledger_rows": None,
}
"""Each Session keyword's default (one per :class:`SessionOptions` key)."""


def session_signature() -> inspect.Signature:
    """``Session(fast, slow=None, *, tenant=None, ...)`` as :func:`inspect.signature` shows it."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([
        inspect.Parameter("fast", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Backend),
        inspect.Parameter("slow", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        *(inspect.Parameter(name, kw, default=default) for name, default in SESSION_DEFAULTS.items()),
    ])


class SessionParts:
    """What a Session is made of: its configuration, the shared parts it uses (discovery, the state store, the
    counters, the warm-ahead sender, the handoff) and what it keeps between requests (stats, the turn ledger, the last
    route, the last two payloads). The :class:`~agentkv.Session` holds one; the steps of a turn read it."""

    def __init__(self, fast: Backend, slow: Backend | None, options: SessionOptions,
                 registered: Callable[[Sequence[Backend]], tuple[Processor, ...]]) -> None:
        """``options``: the Session's keyword arguments; ``registered``: the processors its backends' events go
        through (:func:`agentkv._session.processors.registered`)."""
        check_backends(fast, slow)
        unknown = sorted(set(options) - set(SESSION_DEFAULTS))
        if unknown:
            raise TypeError(f"Session() got an unexpected keyword argument {unknown[0]!r}")
        self.fast, self.slow = fast, slow
        self.tenant = tenant = options.get("tenant")
        self.session_id = options.get("session_id") or str(uuid.uuid4())
        self.routing: RoutePolicy = _option(options, "routing")
        self.warm_ahead: WarmAheadPolicy = _option(options, "warm_ahead")
        self.retry: RetryPolicy = _option(options, "retry")
        self.state = resolve_state(options.get("state"), options.get("cooldowns"), options.get("in_flight"))
        self.discovery = options.get("discovery") or discovery_for(self.state)
        self._identities(options.get("cache_salt"), options.get("cache_salt_secret") or _env.cache_salt_secret())
        self._pools()
        self.slow_prompt_tokens: int | None = None  # the last slow answer's prompt (what its next turn expects cached)
        self.crossed = False  # this conversation crossed the warm threshold (the cost gate's escalation tally)
        self.escalation_tallied = False
        self.cache_end: int | None = None  # messages the last hosted cache write covered (a warm's, a slow turn's)
        self.last_facts: Facts | None = None  # a pooled Session's last gathered facts (its homes, the replicas down)
        self.request_timeout_s = check_timeout(_option(options, "request_timeout_s"))
        client = options.get("client")
        self.http: HttpTransport = options.get("http") or default_http()
        self.counters = {b.label: TokenCounter.for_backend(b, use_server=_option(options, "count_with_server"),
                                                           http=self.http,
                                                           estimate_first=not _option(options, "count_exactly"))
                         for b in self.backends()}
        handoff = _option(options, "handoff")
        self.handoff = handoff if isinstance(handoff, Handoff) else Handoff(
            handoff, options.get("mapper"), min_attention_cosine=options.get("min_attention_cosine"))
        self.session_stats = SessionStats()
        self.last_route: RouteDecision | None = None
        self.history: list[Payload] = []
        self.jobs = BackgroundJobs()
        # each provider's part (Gemini's explicit caches): its requests go through them, close releases what they hold
        self.providers = SessionProviders(self.backends(), SessionContext(self.session_id, tenant, self.http,
                                                                          self.session_stats, self.jobs))
        self.client: CompletionClient = self.providers.client(client if client is not None else _env.LazyLitellm())
        self.recorder = Recorder(self.session_stats, rows=options.get("ledger_rows"), session=self.session_id,
                                 tenant=tenant, report=self.report)
        self.sends = LitellmSends()  # the tools as litellm sends them, rebuilt when the caller's change
        self._warming(options.get("clock") or time.monotonic, options.get("cache_ledger"))
        self.pipeline = Pipeline(registered(self.backends()))  # each turn event through the processors that apply
        self.closed = False

    def _identities(self, cache_salt: str | bool | None, secret: str | None) -> None:
        """The tenant's salt, the conversation's routing key and the tenant's digest, each keyed by ``secret``."""
        self.cache_salt = resolve_cache_salt(self.tenant, cache_salt, secret,
                                             self_hosted=any(b.self_hosted for b in self.backends()))
        self.routing_key = routing_key(self.tenant, self.session_id, secret)  # opaque: routers log headers
        self.tenant_digest = tenant_digest(self.tenant, secret)  # what spans carry for the tenant
        adopt = getattr(getattr(self.state, "keys", None), "adopt", None)  # a store with ids at rest (Redis)
        if secret and callable(adopt):
            adopt(secret)  # keys them by this secret unless it has one

    def _pools(self) -> None:
        """Each pool's replicas as Backends (label -> url -> replica), every pooled URL (what ejections are read
        for), each pool's name in the store and this conversation's order of its replicas (the key is fixed)."""
        self.ejections = ejections_for(self.state)
        self.replicas = {b.label: {url: b.replica(url) for url in b.replicas} for b in self.backends() if b.is_pool}
        self.pooled = tuple(url for b in self.backends() for url in b.replicas)
        self.pool_ids = {b.label: pool_id(b.label, b.replicas) for b in self.backends() if b.is_pool}
        self.rankings = {b.label: ranked(self.routing_key, b.replicas) for b in self.backends() if b.is_pool}

    def _warming(self, clock: Callable[[], float], ledger: CacheLedger | None) -> None:
        """The warm-ahead sender, event-aware when ``ledger`` follows the slow backend."""
        slow = self.slow
        self.warm = WarmAhead(self.warm_ahead, self.state, self.session_stats, session_id=self.session_id,
                              tenant=self.tenant, clock=clock,
                              tenant_key=None if self.tenant is None else self.tenant_digest,
                              ejections=self.ejections, cooloff_s=self.retry.replica_cooloff_s)
        self.cache_ledger = ledger
        followed = [b for b in self.members(slow) if ledger.follows(b)] if ledger is not None and slow else []
        self.residency: SlowResidency | None = None  # event-aware warms' view of slow (a pool's: its replica, per turn)
        if ledger is not None and slow is not None and followed:
            self.residency = SlowResidency(ledger, followed[0], self.cache_salt, self.counter(slow))
            self.warm.follow(self.residency)

    def report(self, event: TurnEvent) -> None:
        """Pass ``event`` through this Session's processors (:mod:`agentkv._session.pipeline`)."""
        self.pipeline.report(self, event)

    def closing(self) -> "Machine[None]":
        """Refuse requests from now on; what a provider's part holds outside (Gemini's caches) is released in the
        background (``drain_warms`` waits for it)."""
        self.closed = True
        if self.providers.pending():
            yield Spawn(self.providers.close, _CLOSE_TIMEOUT_S)

    def backends(self) -> list[Backend]:
        return [b for b in (self.fast, self.slow) if b is not None]

    def backend(self, role: str) -> Backend:
        return self.slow if role == "slow" and self.slow is not None else self.fast

    def addressed(self, role: str, facts: Facts | None = None, avoid: frozenset[str] | set[str] = frozenset()) -> Backend:
        """The backend ``role`` names, addressed to this conversation's replica when it is a pool: its home
        (``facts.homes``; the last gathered facts when None) unless that is down (``facts.down``) or in ``avoid`` (found
        down this turn), else its first choice (:func:`~agentkv.fleet.choose`) that is neither."""
        backend = self.backend(role)
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

    def members(self, backend: Backend, down: frozenset[str] = frozenset()) -> list[Backend]:
        """What discovery asks for ``backend``'s window: each replica of a pool not ``down`` (all when every one is),
        else the backend."""
        if not backend.is_pool:
            return [backend]
        replicas = self.replicas[backend.label]
        return [r for url, r in replicas.items() if url not in down] or list(replicas.values())

    def counter(self, backend: Backend) -> TokenCounter:
        return self.counters[backend.label]

    @property
    def keeps_caller_salt(self) -> bool:
        return keeps_caller_salt(self.tenant, self.cache_salt)

    def stamp(self) -> float | None:
        """The publishers' clock now (vLLM stamps event batches with ``time.time()``; the prediction reads the ledger
        as of it, whatever clock the ledger was given); None without a ledger."""
        return time.time() if self.cache_ledger is not None else None


def _option(options: SessionOptions, name: str) -> Any:
    """The Session keyword ``name`` as given, else its default."""
    return cast(Mapping[str, Any], options).get(name, SESSION_DEFAULTS[name])
