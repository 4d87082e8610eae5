"""Providers: everything that differs by kind of backend, one strategy module per kind.

A kind (:mod:`agentkv.providers.kinds`: ``vllm``, ``anthropic``, ``openai``, ``gemini``, ``managed``) has one
:class:`ProviderStrategy`, which owns what its requests carry (the salt, breakpoints, cache key, explicit cache:
:meth:`~ProviderStrategy.marked`), the warm's URL, its prices and shortest cacheable prompt, whether an answer moved
the conversation's cache, and, per Session, the state it keeps and cleans up at close
(:meth:`~ProviderStrategy.session_part`: Gemini's explicit caches):

    strategy_for(backend).marked(backend, call, Marks(salt=salt, routing_key=key, cache_end=end))

- :mod:`~agentkv.providers.vllm`: a self-hosted OpenAI-compatible server (its ``cache_salt``, its raw warms);
- :mod:`~agentkv.providers.managed`: what every managed API shares, and the strategy of the unnamed ones;
- :mod:`~agentkv.providers.anthropic`, :mod:`~agentkv.providers.openai`, :mod:`~agentkv.providers.gemini`;
- :mod:`~agentkv.providers.prices`: what an answer cost and what its cache read saved.

Adding a provider is one module with its strategy and one row in :data:`agentkv.providers.kinds.KINDS`. A kind's
strategy module is imported when a backend of it is first used, so ``import agentkv`` loads none of them.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from agentkv.events import emit
from agentkv.providers.kinds import KINDS, PROVIDERS, Provider, kind_of, provider_of
from agentkv.providers.prices import Prices, cache_usage, read_saving, request_cost

if TYPE_CHECKING:
    from agentkv._support.effects import Machine
    from agentkv._support.jobs import BackgroundJobs
    from agentkv.backends import Backend
    from agentkv.http.transport import HttpTransport
    from agentkv.protocols import CompletionClient
    from agentkv.stats import SessionStats
    from agentkv.wire.usage import Usage

__all__ = ["KINDS", "PROVIDERS", "Marks", "Provider", "ProviderStrategy", "SessionContext", "SessionPart", "SessionProviders",
           "account", "loaded_prices", "provider_of", "strategy_for"]


@dataclass(frozen=True)
class Marks:
    """What a conversation's requests are marked with: the tenant's ``salt`` (``keep_caller_salt``: the caller's own
    may go), its routing key, and ``cache_end``, how many of its messages its last cache write covered (the warm's,
    or the previous slow turn's; None: none yet)."""

    salt: str | None = field(default=None, repr=False)  # a salt is a capability: never in a repr
    keep_caller_salt: bool = False
    routing_key: str | None = field(default=None, repr=False)
    cache_end: int | None = None


@dataclass(frozen=True)
class SessionContext:
    """What a provider's per-Session part is given: the Session's id and tenant, its HTTP seam, stats and jobs."""

    session_id: str
    tenant: str | None
    http: "HttpTransport"
    stats: "SessionStats"
    jobs: "BackgroundJobs"


class SessionPart(Protocol):
    """A provider's state in one Session (Gemini's explicit caches): the client its requests go through, and what
    close cleans up."""

    def client(self, inner: "CompletionClient") -> "CompletionClient":
        """``inner``, or a client over it that does this provider's part of each request."""

    def pending(self) -> bool:
        """Whether close has something to clean up."""

    def close(self) -> "Machine[None]":
        """Clean up (never raises); the Session spawns it at close."""


class ProviderStrategy(Protocol):
    """Everything that differs by kind of backend. Each method takes the backend it is about (one strategy serves
    every backend of its kind)."""

    name: str

    def marked(self, backend: "Backend", call: Mapping[str, Any], marks: Marks) -> dict[str, Any]:
        """``call`` (litellm kwargs addressed to ``backend``) with this provider's marks: vLLM's salt, Anthropic's
        breakpoints, OpenAI's cache key, Gemini's explicit cache; the caller's objects never edited."""

    def warm_url(self, backend: "Backend", *, text: bool = False) -> str | None:
        """The URL a warm to ``backend`` is POSTed to raw (``/completions`` for a ``text`` completion), or None to send
        it through litellm."""

    def prices(self, backend: "Backend") -> "Prices | None":
        """``backend``'s prices (imports litellm; None: self-hosted or unpriced)."""

    def cache_minimum(self, backend: "Backend") -> int | None:
        """``backend``'s shortest cacheable prompt (None: no minimum, a self-hosted server)."""

    def cache_moves(self, backend: "Backend", usage: "Usage") -> bool:
        """Whether an answer from ``backend`` moved the conversation's last cache write to the end of its request."""

    def session_part(self, backends: Sequence["Backend"], context: SessionContext) -> SessionPart | None:
        """This provider's state in a Session whose backends of this kind are ``backends`` (None: it keeps none)."""


_loaded: dict[str, ProviderStrategy] = {}


def strategy_for(backend: "Backend | str") -> ProviderStrategy:
    """The strategy of ``backend``'s kind (or of the kind named), its module imported on first use."""
    name = backend if isinstance(backend, str) else backend.provider_kind
    strategy = _loaded.get(name)
    if strategy is None:
        module, _, attribute = kind_of(name).strategy.partition(":")
        strategy = _loaded[name] = getattr(importlib.import_module(module), attribute)
    return strategy


class SessionProviders:
    """The per-Session parts of the providers a Session's backends are served by: its completion client goes through
    each of them, and its close cleans each up."""

    def __init__(self, backends: Sequence["Backend"], context: SessionContext) -> None:
        kinds = dict.fromkeys(b.provider_kind for b in backends)
        found = (strategy_for(kind).session_part([b for b in backends if b.provider_kind == kind], context)
                 for kind in kinds)
        self._parts = tuple(part for part in found if part is not None)

    def client(self, inner: "CompletionClient") -> "CompletionClient":
        """``inner`` wrapped by each provider part that wraps it."""
        for part in self._parts:
            inner = part.client(inner)
        return inner

    def pending(self) -> bool:
        """Whether close has something to clean up."""
        return any(part.pending() for part in self._parts)

    def close(self) -> "Machine[None]":
        """Clean up each provider part (never raises): the Session spawns it."""
        for part in self._parts:
            yield from part.close()


# ----------------------------------------------------------------- what an answer cost

def loaded_prices(backend: "Backend") -> Prices | None:
    """The prices of a managed ``backend``, as its provider's strategy reads them; None when self-hosted, unpriced,
    or litellm is not loaded yet."""
    if "litellm" not in sys.modules:
        return None
    return strategy_for(backend).prices(backend)


def account(stats: "SessionStats", backend: "Backend", usage: Usage, *, warm: bool = False, escalation: bool = False,
            session: str | None = None) -> None:
    """A managed API's answer's cache tokens and dollars into ``stats``; a warm's and an escalation's shares apart. Never
    raises: an answer's accounting is diagnostics, and a turn never fails for it."""
    if backend.self_hosted:
        return
    try:
        _account(stats, backend, usage, warm=warm, escalation=escalation, session=session)
    except Exception as exc:
        emit("cost_unread", level="warning", backend=backend.label, error=type(exc).__name__, session=session)


def _account(stats: "SessionStats", backend: "Backend", usage: Usage, *, warm: bool, escalation: bool,
             session: str | None) -> None:
    tokens = cache_usage(usage)
    stats.add("cache_write_tokens", tokens.cache_write)
    stats.add("cache_read_tokens", tokens.cache_read)
    if warm:
        stats.add("warm_cache_write_tokens", tokens.cache_write)
    if escalation:
        stats.add("escalation_cache_read_tokens", tokens.cache_read)
    prices = loaded_prices(backend)
    cost = saved = None
    if prices is not None:
        cost, saved = request_cost(tokens, prices), read_saving(tokens, prices)
        stats.add_usd("cost_usd", cost)
        stats.add_usd("cache_saved_usd", saved)
        if warm:
            stats.add_usd("warm_cost_usd", cost)
        if escalation:
            stats.add_usd("escalation_saved_usd", saved)
    emit("warm_cost" if warm else "hosted_cache", backend=backend.label, prompt=tokens.prompt_tokens,
         cache_write=tokens.cache_write, cache_read=tokens.cache_read, cost_usd=cost, saved_usd=saved,
         escalation=escalation or None, session=session)
