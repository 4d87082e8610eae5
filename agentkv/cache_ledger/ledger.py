"""``CacheLedger``: what each server's prefix cache holds right now, per tenant, from vLLM's KV events.

Usage::

    ledger = CacheLedger([Backend("hosted_vllm/big", api_base=..., kv_events="tcp://10.0.0.5:5557",
                                  kv_events_replay="tcp://10.0.0.5:5558")]).start()
    ledger = CacheLedger.discover([fast, big]).start()        # endpoints from each server's /kv_event_sources
    ledger.resident_tokens("big", token_ids, cache_salt)      # what a request would find cached
    ledger.eviction_ranking("big", tenant="acme")            # acme's blocks, coldest first
    ledger.eviction_ranking("big", as_vram_manager=True)     # every tenant's: the VRAM manager only
    ledger.record("big", predicted, usage.cached_tokens, prompt_tokens=usage.prompt_tokens)
    ledger.cross_check("big")                                # opens a window on the server's /metrics
    check = ledger.cross_check("big")                        # that window: server hit rate beside the ledger's
    ledger.stop()
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from agentkv.http.transport import HttpError, HttpTransport, default_http
from agentkv.errors import AgentKVError, ConfigurationError
from agentkv.events import emit
from agentkv.cache_ledger.hit_rate import HitCounters, HitRateCheck, compare, server_counters
from agentkv.cache_ledger.sources import Subscription, from_backend, from_sources
from agentkv.cache_ledger.subscriber import EndpointSubscriber
from agentkv.cache_ledger.tree import BlockTree
from agentkv.tenancy import salts_for_tenant, tenant_for_salt

__all__ = ["CacheLedger", "LedgerStats", "RankedBlock", "TenantScopeError"]


class TenantScopeError(AgentKVError, PermissionError):
    """An eviction ranking was asked for without a tenant: it would rank every tenant's blocks together."""


@dataclass(frozen=True)
class RankedBlock:
    """One resident block in an eviction ranking."""

    block_hash: Hashable
    tenant: str | None
    depth: int
    tokens: int
    last_used: float


@dataclass(frozen=True)
class LedgerStats:
    """One backend's subscription: what it has applied, what it could not repair, how well it predicted.

    ``replays``: replay requests sent (one at start, one per gap); ``replay_timeouts``: those whose end marker never
    came within the replay timeout (each cost the subscription thread that long)."""

    backend: str
    blocks: int
    resident_tokens: int
    batches: int
    events: int
    gaps: int
    replayed: int
    unrepaired: int
    resets: int
    forgotten: int
    errors: int
    predictions: int = 0
    exact_predictions: int = 0
    predicted_tokens: int = 0
    cached_tokens: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    replays: int = 0
    replay_timeouts: int = 0

    @property
    def hit_rate(self) -> float | None:
        """Tokens found cached ÷ tokens queried, over the records that gave ``prompt_tokens``; None before one."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None


class CacheLedger:
    """Subscribes to every backend that declares ``kv_events``; one background thread per endpoint. A pool
    (``Backend(api_base=[...], kv_events=[...])``) is followed replica by replica, each under its label and URL."""

    def __init__(self, backends: Iterable[Any], *, max_blocks_per_backend: int = 1 << 20,
                 replay_timeout_s: float = 1.0, clock: Callable[[], float] = time.time,
                 http: HttpTransport | None = None, sources: Mapping[str, Subscription] | None = None) -> None:
        """``http``: the seam :meth:`cross_check` scrapes ``/metrics`` through (default: the process-wide one).
        ``sources``: per backend label, the :class:`~agentkv.cache_ledger.sources.Subscription` to follow instead of what
        its ``kv_events`` declare (what :meth:`discover` builds from the server's ``/kv_event_sources``)."""
        self.clock = clock
        self.http = http
        self._roots: dict[str, str | None] = {}
        # the last scrape that closed a window: its ticket, when, the server's counters and the ledger's
        self._windows: dict[str, tuple[int, float, HitCounters, HitCounters]] = {}
        self._tickets: dict[str, int] = {}  # scrapes begun per backend: a later ticket began later
        self._trees: dict[str, BlockTree] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._subscribers: dict[str, EndpointSubscriber] = {}
        self._sources: dict[str, Subscription] = {}
        # predictions, exact ones, tokens predicted, tokens cached, and tokens queried and hit (records with a prompt)
        self._accuracy: dict[str, tuple[int, ...]] = {}
        sources = dict(sources or {})
        for backend in _servers(backends):
            name = _name(backend)
            source = sources.get(name)
            if source is None and getattr(backend, "kv_events", None) is None:
                continue
            if name in self._trees:
                raise ConfigurationError(f"two backends named {name!r} publish KV events; name them apart")
            source = self._sources[name] = source or from_backend(backend)
            self._trees[name] = BlockTree(max_blocks=max_blocks_per_backend)
            self._locks[name] = threading.Lock()
            self._accuracy[name] = (0, 0, 0, 0, 0, 0)
            self._roots[name] = getattr(backend, "server_root", None)
            self._subscribers[name] = EndpointSubscriber(
                name, source.endpoint, source.replay_endpoint, self._trees[name], self._locks[name],
                topic=source.topic, bind=source.bind, replay_timeout_s=replay_timeout_s)

    @classmethod
    def discover(cls, backends: Iterable[Any], *, http: HttpTransport | None = None, timeout_s: float = 5.0,
                 rank: int | None = None, **options: Any) -> CacheLedger:
        """A ledger following every backend whose server publishes KV events, as ``GET /kv_event_sources`` says.

        A backend that declares ``kv_events`` is followed as declared; any other with an ``api_base`` is asked (vLLM
        answers ``{rank: KVEventsConfig}``): a bound endpoint (``tcp://*:P``) is connected to at the server's host,
        one vLLM connects to is bound, and the topic is vLLM's. A server without events (``{}``) or without the
        route (404: not vLLM, or one before it) is skipped. ``rank``: which data-parallel rank to follow (needed when
        the server has several). ``options`` go to the constructor (``http`` too). Raises
        :class:`agentkv.http.transport.HttpError` when a server cannot be asked, :class:`ConfigurationError` when its
        answer names no usable endpoint."""
        backends = list(backends)
        transport = http or default_http()
        sources: dict[str, Subscription] = {}
        for backend in _servers(backends):  # a pool's replicas are asked each
            root = getattr(backend, "server_root", None)
            if getattr(backend, "kv_events", None) is not None or root is None:
                continue
            try:
                answer = transport.request("GET", f"{root}/kv_event_sources", timeout_s=timeout_s)
            except HttpError as exc:
                if exc.status_code != 404:
                    raise
                answer = {}
            source = from_sources(answer, urlsplit(root).hostname or "127.0.0.1", rank=rank)
            emit("ledger.discovered", backend=_name(backend), found=source is not None,
                 bind=source.bind if source else None, replay=bool(source and source.replay_endpoint))
            if source is not None:
                sources[_name(backend)] = source
        return cls(backends, http=http, sources=sources, **options)

    @property
    def backends(self) -> list[str]:
        """The names of the backends this ledger follows."""
        return list(self._trees)

    def start(self, *, wait_s: float = 60.0) -> CacheLedger:
        """Start every subscription thread and wait (up to ``wait_s`` in all) until each has applied what its server's
        replay buffer held, so a ledger started after its servers answers from their history at once; returns self."""
        for subscriber in self._subscribers.values():
            subscriber.start(wait_s=0.0)
        deadline = time.monotonic() + wait_s
        synced = sum(sub.wait_ready(max(0.0, deadline - time.monotonic())) for sub in self._subscribers.values())
        emit("ledger.started", backends=len(self._subscribers), synced=synced)
        return self

    def stop(self) -> None:
        """Stop and join every subscription thread."""
        for subscriber in self._subscribers.values():
            subscriber.stop()

    def __enter__(self) -> CacheLedger:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _name(self, backend: Any) -> str:
        name = backend if isinstance(backend, str) else _name(backend)
        if name not in self._trees:
            raise KeyError(f"the ledger does not follow {name!r} (it declares no kv_events endpoint)")
        return str(name)

    # --- what is resident -------------------------------------------------------------------------

    def resident_tokens(self, backend: Any, token_ids: Sequence[int], cache_salt: str | None, *,
                        as_of: float | None = None) -> int:
        """How many leading tokens of this prompt a request with ``cache_salt`` would find cached, right now.

        ``as_of`` (a publisher-clock reading, ``time.time()`` as vLLM stamps its batches, not :attr:`clock`, which
        may be injected; e.g. when a request was sent): blocks stored after it are ignored, so a
        prediction made after the send is not inflated by the blocks the request itself stored. Blocks evicted
        since are gone from the tree either way (the answer can then fall short), and the comparison assumes the
        publisher's clock agrees with the caller's ``time.time()`` (same host, or NTP-synchronised)."""
        name = self._name(backend)
        with self._locks[name]:
            return self._trees[name].resident_tokens(token_ids, cache_salt, as_of)

    def held_tokens(self, backend: Any, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """How many leading tokens of ``token_ids`` the server holds in full blocks (for a warmed prefix)."""
        name = self._name(backend)
        with self._locks[name]:
            return self._trees[name].held_tokens(token_ids, cache_salt)

    def record(self, backend: Any, predicted: int, actual: int, prompt_tokens: int = 0) -> None:
        """Log one prediction against the ``cached_tokens`` the server then reported (see :meth:`stats`).

        ``prompt_tokens`` (the response's ``usage.prompt_tokens``) makes the record count toward the hit rate:
        ``actual`` tokens hit out of ``prompt_tokens`` queried, as the server's own counters count them. vLLM
        leaves out of those counters a request that skips the cache lookup (``prompt_logprobs``, pooling): record
        such a request without ``prompt_tokens``, or the cross-check shows a negative ``unrecorded_queries``.
        """
        name = self._name(backend)
        queried = (prompt_tokens, actual) if prompt_tokens > 0 else (0, 0)
        with self._locks[name]:
            self._accuracy[name] = tuple(a + b for a, b in zip(self._accuracy[name], (1, int(predicted == actual),
                                                                                        predicted, actual, *queried)))
        if predicted != actual:
            emit("ledger.misprediction", backend=name, predicted=predicted, actual=actual)

    def blocks(self, backend: Any) -> set[Hashable]:
        """The hashes of every block the ledger believes ``backend`` holds (vLLM's integer form)."""
        name = self._name(backend)
        with self._locks[name]:
            return set(self._trees[name].blocks)

    def touch(self, backend: Any, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Record that a request just read this prompt's resident blocks (they are now the warmest)."""
        name = self._name(backend)
        with self._locks[name]:
            # the publishers' clock (stored blocks carry their batch's ``time.time()``), not the injectable one
            return self._trees[name].touch(token_ids, cache_salt, time.time())

    # --- eviction ranking, fail-closed --------------------------------------------------------------

    def eviction_ranking(self, backend: Any, tenant: str | None = None, *, as_vram_manager: bool = False,
                         limit: int | None = None) -> list[RankedBlock]:
        """``tenant``'s resident blocks, coldest first (a chain's tail before its head among equals).

        Without a tenant this raises :class:`TenantScopeError`, unless ``as_vram_manager=True``: the one role
        that must see every tenant's blocks. A block belongs to a tenant only through a salt this process
        derived for it (:func:`agentkv.tenancy.derive_cache_salt`); other salts, and no salt, belong to no one.
        """
        if tenant is None and not as_vram_manager:
            raise TenantScopeError("eviction_ranking needs tenant=...: a ranking across tenants is for the VRAM "
                                   "manager only (as_vram_manager=True)")
        name = self._name(backend)
        salts: set[str | None] | None = None if tenant is None else set(salts_for_tenant(tenant))
        with self._locks[name]:
            ranked = self._trees[name].coldest(salts)[:limit]
        return [RankedBlock(block_hash, tenant_for_salt(block.salt), block.depth, block.tokens, block.last_used)
                for block_hash, block in ranked]

    # --- the hit rate, cross-checked against the server's /metrics -------------------------------------

    def cross_check(self, backend: Any, *, http: HttpTransport | None = None,
                    timeout_s: float = 5.0) -> HitRateCheck | None:
        """Scrape the server's ``/metrics``; the window since the previous scrape, server beside ledger.

        The first call for a backend opens the window and returns None. The server's counters cover every
        client, so only their change between two scrapes is set beside what :meth:`record` logged in between.
        Calls may overlap (threads, tasks): a scrape that answers after one begun later returns None and leaves
        the window alone. Never call it on a request path: it is one HTTP round trip. Raises
        :class:`agentkv.http.transport.HttpError`, or ValueError when the server exposes no prefix-cache counters (vLLM
        with ``--disable-log-stats``).
        """
        name, url, ticket = self._begin_scrape(backend)
        text = (http or self.http or default_http()).request("GET", url, timeout_s=timeout_s, text=True)
        return self._window(name, ticket, server_counters(text))

    async def across_check(self, backend: Any, *, http: HttpTransport | None = None,
                           timeout_s: float = 5.0) -> HitRateCheck | None:
        """:meth:`cross_check` for async code (scrapes without blocking the event loop)."""
        name, url, ticket = self._begin_scrape(backend)
        text = await (http or self.http or default_http()).arequest("GET", url, timeout_s=timeout_s, text=True)
        return self._window(name, ticket, server_counters(text))

    def _begin_scrape(self, backend: Any) -> tuple[str, str, int]:
        """The backend's name, its ``/metrics`` URL and this scrape's ticket (scrapes may overlap)."""
        name = self._name(backend)
        root = self._roots[name]
        if root is None:
            raise ConfigurationError(f"backend {name!r} has no api_base: its /metrics cannot be scraped")
        with self._locks[name]:
            ticket = self._tickets[name] = self._tickets.get(name, 0) + 1
        return name, f"{root}/metrics", ticket

    def _window(self, name: str, ticket: int, server: HitCounters) -> HitRateCheck | None:
        """Close the window since the last scrape (if any) and open the next one here; None for the first scrape,
        and for one overtaken by a scrape that began after it (its counters are older than the window's start)."""
        now = self.clock()
        with self._locks[name]:
            previous = self._windows.get(name)
            if previous is not None and previous[0] > ticket:
                return None
            ledger = HitCounters(*self._accuracy[name][4:6])
            self._windows[name] = (ticket, now, server, ledger)
        if previous is None:
            return None
        check = compare(name, previous[2], server, previous[3], ledger, window_s=now - previous[1])
        emit("ledger.cross_check", backend=name, server_queries=check.server.queries, server_hits=check.server.hits,
             ledger_queries=check.ledger.queries, ledger_hits=check.ledger.hits,
             unrecorded_queries=check.unrecorded_queries, gap=check.gap, reset=check.reset)
        return check

    # --- health -------------------------------------------------------------------------------------

    def stats(self) -> list[LedgerStats]:
        """Per backend: blocks held, tokens they cover, batches applied, gaps seen, repaired and not, how
        :meth:`record`-ed predictions compared with the ``cached_tokens`` the server reported, and the hit rate
        (``hit_rate``: tokens hit ÷ tokens queried, process-wide; :meth:`cross_check` sets it beside the server's)."""
        out = []
        for name, tree in self._trees.items():
            sub = self._subscribers[name]
            with self._locks[name]:
                blocks = len(tree)
                tokens = sum(block.tokens for block in tree.blocks.values())
                accuracy = self._accuracy[name]
            predictions, exact, predicted, cached, queried, hit = accuracy
            out.append(LedgerStats(name, blocks, tokens, sub.batches, sub.events, sub.gaps, sub.replayed,
                                   sub.unrepaired, tree.resets, tree.forgotten, sub.errors, predictions, exact,
                                   predicted, cached, queried, hit, sub.replays, sub.replay_timeouts))
        return out

    def block_size(self, backend: Any) -> int | None:
        """``backend``'s block size as its events declare it (None before the first ``BlockStored``)."""
        name = self._name(backend)
        with self._locks[name]:
            return self._trees[name].block_size

    def follows(self, backend: Any) -> bool:
        """True when this ledger follows ``backend``: a backend of that name declared a ``kv_events`` endpoint the
        ledger subscribed to, and (for a Backend) at the same server (a namesake elsewhere is not the tree's server)."""
        name = backend if isinstance(backend, str) else _name(backend)
        if name not in self._trees:
            return False
        return isinstance(backend, str) or getattr(backend, "server_root", None) == self._roots[name]

    def live(self, backend: Any) -> bool:
        """True while ``backend``'s subscription runs (started, not stopped): its tree is kept current. A stopped or
        never-started ledger still answers from its last tree, which nothing corrects any more."""
        name = backend if isinstance(backend, str) else _name(backend)
        return name in self._subscribers and self._subscribers[name].running

    def subscription(self, backend: Any) -> Subscription:
        """Where the ledger follows ``backend``'s events: the endpoint (bound or connected to), replay and topic."""
        return self._sources[self._name(backend)]

    def last_seq(self, backend: Any) -> int:
        """The last sequence number applied for ``backend`` (-1 before the first)."""
        return self._subscribers[self._name(backend)].last_seq


def _servers(backends: Iterable[Any]) -> list[Any]:
    """Every server ``backends`` name: a pool's replicas each (followed apart), any other backend as it is."""
    return [replica for backend in backends
            for replica in ([backend.replica(url) for url in backend.replicas] if getattr(backend, "is_pool", False)
                            else [backend])]


def _name(backend: Any) -> str:
    """The name the ledger follows ``backend``'s server under (a pool replica's label and URL)."""
    return str(getattr(backend, "replica_name", None) or backend.label)
