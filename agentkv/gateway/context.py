"""What one gateway process shares across its requests, built at startup and closed at shutdown: the two
backends, the state store and discovery, the keys, the conversations' Sessions, the upstream HTTP client,
and the metrics.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import agentkv._support.env as _env
from agentkv.http.transport import HttpAnswer, HttpTransport, redact_url
from agentkv._session import Session
from agentkv.backends import Backend
from agentkv.conversations import LEDGER_ROWS, SessionMap, session_id
from agentkv.discovery import WindowDiscovery
from agentkv.events import digest, emit
from agentkv.gateway.auth import ANONYMOUS, ApiKeys, bearer_token, load_api_keys, salt_secret
from agentkv.gateway.config import GatewayConfig, urls_of
from agentkv.gateway.metrics import GatewayMetrics
from agentkv.gateway.upstream import Upstream
from agentkv.state import InProcessStore, StateStore
from agentkv.state.config import redis_store_for
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy

__all__ = ["LEDGER_ROWS", "GatewayContext", "backends_of"]

_Key = tuple[str, str]  # (tenant, conversation)



def backends_of(config: GatewayConfig) -> tuple[Backend, Backend]:
    """The fast and slow :class:`Backend` s: self-hosted OpenAI-compatible servers (or pools of them), named "fast"
    and "slow"."""
    fast, slow = urls_of(config.fast_url), urls_of(config.slow_url)
    return (Backend(f"hosted_vllm/{config.fast_model}", api_base=fast[0], replicas=fast, name="fast"),
            Backend(f"hosted_vllm/{config.slow_model}", api_base=slow[0], replicas=slow, name="slow"))


class GatewayContext:
    """One gateway process's shared state. ``upstream`` replaces the upstream client, ``state`` the store (tests)."""

    def __init__(self, config: GatewayConfig, *, upstream: HttpTransport | None = None,
                 state: StateStore | None = None) -> None:
        self.config = config
        self.created = int(time.time())
        self.fast, self.slow = backends_of(config)
        self.keys: ApiKeys | None = load_api_keys(config.api_keys) if config.api_keys else None
        self.secret = salt_secret(_env.cache_salt_secret(), self.keys)
        redis_url = config.redis_url or _env.redis_url()
        # the cooldown map holds as many conversations as the gateway does (the library's default is 256)
        self.warm_ahead = WarmAheadPolicy(max_sessions=config.max_sessions)
        self.state: StateStore = state or (redis_store_for(redis_url) if redis_url else InProcessStore(
            CooldownMap(config.max_sessions, self.warm_ahead.cooldown_s), InFlightLimit(self.warm_ahead.max_in_flight)))
        # all of the gateway's HTTP goes through one seam: the relayed POSTs (pooled keep-alive connections,
        # agentkv.gateway.upstream: no auth, redirects or cookies), discovery, /tokenize and warms
        self.upstream: HttpTransport = upstream or Upstream(connect_timeout_s=config.connect_timeout_s,
                                                            read_timeout_s=config.read_timeout_s)
        # windows are discovered per gateway (a Redis store shares them, and corrections, with every process)
        self.discovery = WindowDiscovery(http=self.upstream, state=None if isinstance(self.state, InProcessStore)
                                         else self.state)
        self.metrics = GatewayMetrics()
        self.sessions: SessionMap[_Key, Session] = SessionMap(
            self._new_session, max_sessions=config.max_sessions, idle_s=config.session_idle_s,
            on_drop=lambda session: session.close())
        emit("gateway.ready", fast=[redact_url(u) for u in self.fast.replicas] or redact_url(self.fast.api_base or ""),
             slow=[redact_url(u) for u in self.slow.replicas] or redact_url(self.slow.api_base or ""),
             tenants=len(self.keys.tenants) if self.keys else 0, shared_state=redis_url is not None,
             salted=self.secret is not None)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant a request's ``Authorization`` header names (the anonymous one without a keys file)."""
        if self.keys is None:
            return ANONYMOUS
        return self.keys.tenant(bearer_token(authorization))

    def session(self, tenant: str, conversation: str) -> Session:
        """The conversation's Session (built on its first request; the map's size is exported on each scrape)."""
        return self.sessions.get((tenant, conversation))

    def _new_session(self, key: _Key) -> Session:
        tenant, conversation = key
        salted: dict[str, Any] = {"cache_salt_secret": self.secret} if self.secret else {"cache_salt": False}
        emit("gateway.session.new", tenant=tenant, conversation=digest(conversation), held=len(self.sessions))
        return Session(self.fast, self.slow, tenant=tenant, session_id=session_id(conversation), state=self.state,
                       discovery=self.discovery, warm_ahead=self.warm_ahead, ledger_rows=LEDGER_ROWS, http=self.upstream,
                       **salted)

    async def send(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> HttpAnswer:
        """POST ``content`` (JSON) to ``url`` upstream with ``headers`` (the conversation's routing key); the answer's
        body is left unread (a stream)."""
        return await self.upstream.post(url, content, headers)

    async def aclose(self) -> None:
        """Close the upstream connections (the process's Sessions need nothing closed)."""
        await self.upstream.aclose()
