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
from agentkv._session.inputs import check_backends, check_timeout
from agentkv._session.record import Recorder
from agentkv.backends import Backend
from agentkv.discovery import WindowDiscovery, discovery_for
from agentkv.handoff.escalation import Handoff
from agentkv.protocols import CompletionClient
from agentkv.retry import RetryPolicy
from agentkv.routing import RouteDecision, RoutePolicy
from agentkv.state import StateStore
from agentkv.state.config import resolve_state
from agentkv.stats import SessionStats
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
        self.cache_salt = resolve_cache_salt(tenant, cache_salt, cache_salt_secret or _env.cache_salt_secret(),
                                             self_hosted=any(b.api_base for b in self._backends()))
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
        self._warm = WarmAhead(warm_ahead, self.state, self._stats, self._jobs, session_id=self.session_id,
                               tenant=tenant, clock=clock or time.monotonic)
        self._record = Recorder(self._stats, rows=ledger_rows)
        self._sends = LitellmSends()  # the tools as litellm sends them, rebuilt when the caller's change
        self.cache_ledger = ledger
        if ledger is not None and slow is not None and ledger.follows(slow):
            self._warm.attach(SlowResidency(ledger, slow, self.cache_salt, self._counter(slow)))
        self.closed = False

    def _backends(self) -> list[Backend]:
        return [b for b in (self.fast, self.slow) if b is not None]

    def _backend(self, role: str) -> Backend:
        return self.slow if role == "slow" and self.slow is not None else self.fast

    def _counter(self, backend: Backend) -> TokenCounter:
        return self.counters[backend.label]

    @property
    def _keeps_caller_salt(self) -> bool:
        return keeps_caller_salt(self.tenant, self.cache_salt)

    def _stamp(self) -> float | None:
        """The publishers' clock now (vLLM stamps event batches with ``time.time()``; the prediction reads the ledger
        as of it, whatever clock the ledger was given); None without a ledger."""
        return time.time() if self.cache_ledger is not None else None
