"""Many conversations through one object: :class:`Conversations` holds one Session per conversation.

An agent service builds its model client once and serves every conversation through it. ``Conversations`` is what
that client is given instead of a Session: for each request it finds the conversation (:func:`conversation_id`: an
explicit id, else the body's ``user``, else the opening's fingerprint) under the tenant (fixed, or ``tenant_of``
applied to the request: never read from what the caller sends), and answers that conversation's Session, built on
first use with the keywords it was given, held in a bounded map (:class:`SessionMap`), its guards shared with every
other Session through one state store.

    convs = Conversations(fast, slow, tenant_of=lambda request: keys[request.headers["authorization"]],
                          cache_salt_secret=secret, max_sessions=10_000, idle_s=1800)
    session = convs.session_for("thread-42", body={"messages": messages, "tools": tools}, request=request)
    convs.stats()["totals"]["escalations"]; convs.close()

Every integration that takes a Session takes a ``Conversations`` too (:func:`session_of` per request).
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

import agentkv._support.env as _env
from agentkv._session import Session
from agentkv.backends import Backend
from agentkv.conversations.identity import conversation_id, session_id
from agentkv.conversations.sessions import SessionMap
from agentkv.errors import ConfigurationError
from agentkv.events import digest, emit
from agentkv.state import InProcessStore, StateStore
from agentkv.state.config import resolve_state
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy

__all__ = ["LEDGER_ROWS", "Conversations", "session_of"]

LEDGER_ROWS = 32
"""Ledger rows each conversation's Session keeps unless told (``ledger_rows=``): a conversation can last as long as
its client keeps its id, and its memory must not grow with its turns."""
_MAX_TENANT = 256
_PER_CONVERSATION = ("session_id", "tenant", "tenant_of")  # never one for all: each conversation's own
_Key = tuple[str, str]  # (tenant, conversation)
S = TypeVar("S")


def refusal(fast: Any, slow: Any, tenant: Any, tenant_of: Any, kwargs: Mapping[str, Any]) -> str | None:
    """Why these arguments cannot build a :class:`Conversations` (a phrase naming the argument), or None."""
    if not isinstance(fast, Backend) or not (slow is None or isinstance(slow, Backend)):
        return "Conversations(fast, slow) takes Backend objects (slow may be None)"
    if (tenant is None) == (tenant_of is None):
        return "Conversations needs exactly one of tenant= (every conversation's) or tenant_of= (request -> tenant)"
    if tenant_of is not None and not callable(tenant_of):
        return f"Conversations(tenant_of=...) must be a callable (request -> tenant), got {type(tenant_of).__name__}"
    if "session_id" in kwargs:
        return ("Conversations(session_id=...) is refused: each conversation's Session gets its own id, from the "
                "conversation's identity (an explicit id, the body's user, or the opening's fingerprint)")
    known = set(inspect.signature(Session).parameters) - {"fast", "slow", *_PER_CONVERSATION}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        return f"Conversations got {unknown[0]}=..., which a Session does not take"
    return salt_refusal(fast, slow, kwargs)


def salt_refusal(fast: Backend, slow: Backend | None, kwargs: Mapping[str, Any]) -> str | None:
    """Why the salts of the tenants served cannot be what they must (each tenant's own), or None."""
    salt = kwargs.get("cache_salt")
    if salt is not None and salt is not False:
        return ("Conversations(cache_salt=...) is refused unless False: one fixed salt would put every tenant in one "
                "cache group; pass cache_salt_secret=... (each tenant's salt is derived from it)")
    secret = kwargs.get("cache_salt_secret") or _env.cache_salt_secret()
    if salt is None and not secret and any(b.self_hosted for b in (fast, slow) if b is not None):
        return ("Conversations serves tenants on a self-hosted backend but has no cache-salt secret, so their requests "
                "would share the prefix cache: pass cache_salt_secret=... or set AGENTKV_CACHE_SALT_SECRET (or "
                "cache_salt=False to share it knowingly)")
    return None


def checked_tenant(tenant: object, source: str) -> str:
    """``tenant`` when it is a Session tenant (a non-empty string, at most 256 characters), else a
    :class:`ConfigurationError` naming ``source``; the value is never quoted (it may come from a credential)."""
    if isinstance(tenant, str) and 0 < len(tenant) <= _MAX_TENANT:
        return tenant
    got = f"a string of {len(tenant)} characters" if isinstance(tenant, str) else type(tenant).__name__
    raise ConfigurationError(f"{source} must be a tenant id: a non-empty string of at most {_MAX_TENANT} characters, "
                             f"got {got}")


def shared_store(state: StateStore | None, kwargs: dict[str, Any], max_sessions: int) -> StateStore:
    """The one store every Session shares: ``state``, ``cooldowns=``/``in_flight=`` (taken out of ``kwargs``), or
    ``AGENTKV_REDIS_URL``'s; else, as the gateway's, a store of this object's own whose cooldown map holds as many
    conversations per tenant as the map does (the process default holds 256)."""
    cooldowns, in_flight = kwargs.pop("cooldowns", None), kwargs.pop("in_flight", None)
    if state is not None or cooldowns is not None or in_flight is not None or _env.redis_url():
        return resolve_state(state, cooldowns, in_flight)
    policy = kwargs.get("warm_ahead") or WarmAheadPolicy()
    return InProcessStore(CooldownMap(max(max_sessions, policy.max_sessions), policy.cooldown_s),
                          InFlightLimit(policy.max_in_flight))


def summed(stats: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The numeric fields of many :meth:`Session.stats` summed (a dict of numbers, such as ``requests``, per key)."""
    totals: dict[str, Any] = {}
    for one in stats:
        for name, value in one.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[name] = totals.get(name, 0) + value
            elif isinstance(value, Mapping):
                inner = totals.setdefault(name, {})
                for key, number in value.items():
                    if isinstance(number, (int, float)) and not isinstance(number, bool):
                        inner[key] = inner.get(key, 0) + number
    return totals


class Conversations:
    """One Session per conversation, for a client built once that serves them all.

    ``fast``/``slow`` and the other keywords (``cache_salt_secret``, ``routing``, ``warm_ahead``, ``retry``,
    ``client``, ``http``, …) are what each Session is built with; ``session_id`` and a fixed ``cache_salt`` string are
    refused (:class:`ConfigurationError`), since each conversation and tenant needs its own. The tenant is ``tenant``
    (every conversation's) or ``tenant_of(request)`` (an integrator's function of the request, as the gateway takes
    the tenant from the API key): exactly one of the two, and never a field of what the caller sends. It must return
    a tenant id, never the credential itself (the tenant is named in its Sessions' events). ``state`` is
    the one :class:`~agentkv.state.StateStore` all its Sessions share (warm-ahead cooldowns and in-flight limits,
    windows). At most ``max_sessions`` conversations are held, and one idle ``idle_s`` seconds is dropped (its Session
    closed); ``clock``, when given, is the map's clock as well as each Session's. Each Session keeps the last
    :data:`LEDGER_ROWS` ledger rows unless ``ledger_rows=`` says otherwise. :meth:`session_for` is safe from many
    threads and tasks at once: two calls for one conversation get the same Session.
    """

    def __init__(self, fast: Backend, slow: Backend | None = None, *, tenant: str | None = None,
                 tenant_of: Callable[[Any], str] | None = None, state: StateStore | None = None,
                 max_sessions: int = 10_000, idle_s: float = 1800.0, **session_kwargs: Any) -> None:
        problem = refusal(fast, slow, tenant, tenant_of, session_kwargs)
        if problem is not None:
            raise ConfigurationError(problem)
        self.fast, self.slow = fast, slow
        self.tenant = None if tenant is None else checked_tenant(tenant, "Conversations(tenant=...)")
        self.tenant_of = tenant_of
        self._kwargs = {"ledger_rows": LEDGER_ROWS, **session_kwargs}
        self.state = shared_store(state, self._kwargs, max_sessions)
        clock = session_kwargs.get("clock") or time.monotonic
        self._sessions: SessionMap[_Key, Session] = SessionMap(self._new_session, max_sessions=max_sessions,
                                                               idle_s=idle_s, clock=clock, on_drop=self._dropped)
        self._lock = threading.Lock()
        self.dropped = 0
        self.closed = False

    # ----------------------------------------------------------------- the conversation's Session
    def session_for(self, conversation: str | None = None, body: Mapping[str, Any] | None = None,
                    request: Any = None) -> Session:
        """The Session of the conversation ``conversation`` names (an explicit id: a header, LangGraph's ``thread_id``,
        litellm's ``metadata``), else the one ``body`` belongs to (its ``user``, else its opening's fingerprint),
        under the tenant (``tenant_of(request)`` when given; ``request`` is read for nothing else)."""
        key = (self._tenant(request), conversation_id(conversation, body or {}))
        with self._lock:
            if self.closed:
                raise RuntimeError("this Conversations is closed")
            return self._sessions.get(key)

    def _tenant(self, request: Any) -> str:
        if self.tenant_of is not None:
            return checked_tenant(self.tenant_of(request), "tenant_of(request)")
        assert self.tenant is not None  # one of the two, checked at construction
        return self.tenant

    def _new_session(self, key: _Key) -> Session:
        tenant, conversation = key
        emit("conversation.session.new", tenant=digest(tenant), conversation=digest(conversation),
             held=len(self._sessions))
        return Session(self.fast, self.slow, tenant=tenant, session_id=session_id(conversation), state=self.state,
                       **self._kwargs)

    def _dropped(self, session: Session) -> None:
        """A Session the map dropped releases what it holds outside this process (its Gemini explicit caches, in the
        background). Only then is it closed: closing refuses new requests, and a request that took this Session just
        before the drop (more conversations in flight than ``max_sessions``) must still be answered; a Session with
        nothing to release is simply let go."""
        self.dropped += 1
        if session.holds_outside:
            session.close()

    # ----------------------------------------------------------------- what it holds
    def __len__(self) -> int:
        """The conversations held now."""
        return len(self._sessions)

    def _held(self) -> list[tuple[_Key, Session]]:
        with self._lock:
            return list(zip(self._sessions.keys(), self._sessions.values()))

    def stats(self) -> dict[str, Any]:
        """``conversations`` held, ``dropped`` so far, ``totals`` (their :meth:`Session.stats` numbers summed) and
        ``sessions``: each conversation's stats, keyed by its id (``tenant/id`` when the tenant comes from
        ``tenant_of``: two tenants' conversations may share an id)."""
        held = [(key, session.stats()) for key, session in self._held()]
        sessions = {(c if self.tenant_of is None else f"{t}/{c}"): one for (t, c), one in held}
        return {"conversations": len(held), "dropped": self.dropped, "totals": summed([one for _, one in held]),
                "sessions": sessions}

    def drain_warms(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` (each) for the held Sessions' background work; True when none is left. For tests,
        benchmarks and demos: requests never wait for it."""
        return all([session.drain_warms(timeout_s) for _, session in self._held()])

    async def adrain_warms(self, timeout_s: float = 30.0) -> None:
        """The async twin of :meth:`drain_warms` (warm tasks on this loop, then threads)."""
        for _, session in self._held():
            await session.adrain_warms(timeout_s)

    # ----------------------------------------------------------------- lifecycle
    def _take_all(self) -> list[Session]:
        with self._lock:
            self.closed = True
            return self._sessions.clear()

    def close(self) -> None:
        """Close every Session held (as :meth:`Session.close`: nothing waits) and refuse further conversations."""
        for session in self._take_all():
            session.close()

    async def aclose(self) -> None:
        """The async twin of :meth:`close`."""
        for session in self._take_all():
            await session.aclose()

    def __enter__(self) -> "Conversations":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "Conversations":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def session_of(target: S | Conversations, *, conversation: str | None = None, body: Mapping[str, Any] | None = None,
               request: Any = None) -> S | Session:
    """The Session a request goes through: ``target`` itself when it is a Session, else
    ``target.session_for(conversation, body, request)``."""
    if isinstance(target, Conversations):
        return target.session_for(conversation, body, request)
    return target
