"""Which store a Session uses: the one it is given, else ``AGENTKV_REDIS_URL``'s, else its process's."""

from __future__ import annotations

import agentkv._support.env as _env
from agentkv._support.defaults import process_default, shared
from agentkv.errors import ConfigurationError
from agentkv.state.memory import InProcessStore
from agentkv.state.protocol import StateStore
from agentkv.state.guards import CooldownMap, InFlightLimit

default_store = process_default(InProcessStore, "The process's own guards: the store Sessions use by default.")


def redis_store_for(url: str) -> StateStore:
    """One :class:`~agentkv.state.RedisStore` per URL per process (its connections are pooled)."""
    from agentkv.state.redis import RedisStore

    return shared(("redis_store", url), lambda: RedisStore.from_url(url))


def resolve_state(state: StateStore | None, cooldowns: CooldownMap | None = None,
                  in_flight: InFlightLimit | None = None) -> StateStore:
    """``state``; else an in-process store on the given guards; else ``AGENTKV_REDIS_URL``'s store
    (read at each call); else the process default."""
    if state is not None:
        if cooldowns is not None or in_flight is not None:
            raise ConfigurationError("pass either state= or cooldowns=/in_flight= to a Session, not both")
        return state
    if cooldowns is not None or in_flight is not None:
        return InProcessStore(cooldowns, in_flight)
    url = _env.redis_url()
    return redis_store_for(url) if url else default_store()
