"""Where a ledger subscribes, and whether it binds or connects (pure: strings and JSON in, a Subscription out).

vLLM's publisher (``ZmqEventPublisher._is_bind_endpoint``) **binds** its PUB socket to an endpoint holding ``*``
or ``::``, or starting ``ipc://`` / ``inproc://``, and **connects** it to any other: with ``tcp://10.0.0.9:5557``
vLLM dials out, so the subscriber must be the one bound there. Its replay ROUTER is always bound. So:

- from the server's own configuration (``GET /kv_event_sources``, one entry per data-parallel rank, as vLLM
  resolved it): a bound PUB is connected to, its wildcard host replaced by the server's host
  (``tcp://*:5557`` at ``http://10.0.0.5:8000`` → ``tcp://10.0.0.5:5557``); a connecting PUB's endpoint is bound
  as it is; the replay endpoint is connected to the same way;
- from a :class:`~agentkv.Backend`'s ``kv_events`` / ``kv_events_replay`` (the server's endpoints): both are
  connected to; written as the server's own configuration says them (``tcp://*:5557``), the wildcard host is the
  host of the Backend's ``api_base``. A vLLM that connects out is followed through :func:`from_sources` (or a
  :class:`Subscription` with ``bind=True`` handed to the ledger).

Usage::

    sub = from_sources(default_http().request("GET", root + "/kv_event_sources", timeout_s=5.0), "10.0.0.5")
    sub = from_backend(backend)         # Backend(..., kv_events="tcp://*:5557") at http://10.0.0.5:8000 → 10.0.0.5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

from agentkv.errors import ConfigurationError

__all__ = ["Subscription", "from_backend", "from_sources", "vllm_binds"]

_WILDCARDS = ("*", "::", "[::]", "0.0.0.0")


@dataclass(frozen=True)
class Subscription:
    """One publisher as the ledger reaches it: its PUB endpoint (bound by the ledger when ``bind``), its replay
    endpoint (always connected to), and the topic subscribed to (``""``: every topic)."""

    endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False
    topic: str = ""


def vllm_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (else it connects to it): vLLM's own rule, verbatim."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _host_port(endpoint: str) -> tuple[str, str] | None:
    """``(host, port)`` of a ``tcp://`` endpoint; None for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host:
        raise ConfigurationError(f"a KV-events endpoint needs a port: {endpoint!r}")
    return host, port


def _reachable(endpoint: str, server_host: str) -> str:
    """The address a subscriber connects to for an endpoint the server bound (its wildcard host made concrete)."""
    if endpoint.startswith("inproc://"):
        raise ConfigurationError(f"an inproc:// KV-events endpoint is reachable only inside vLLM: {endpoint!r}")
    parts = _host_port(endpoint)
    if parts is None or parts[0] not in _WILDCARDS:
        return endpoint
    host = f"[{server_host}]" if ":" in server_host and not server_host.startswith("[") else server_host
    return f"tcp://{host}:{parts[1]}"


def _source(sources: Mapping[str, Any], rank: int | None) -> Mapping[str, Any] | None:
    """The rank's entry of ``/kv_event_sources`` (the only one when ``rank`` is None); None when events are off."""
    enabled = {str(k): v for k, v in sources.items() if isinstance(v, Mapping) and v.get("enable_kv_cache_events")
               and v.get("publisher", "zmq") == "zmq"}
    if rank is not None:
        return enabled.get(str(rank))
    if len(enabled) > 1:
        raise ConfigurationError(f"the server publishes KV events for {len(enabled)} data-parallel ranks, each with "
                                 "a prefix cache of its own: name one with rank=")
    return next(iter(enabled.values()), None)


def from_sources(sources: Mapping[str, Any], server_host: str, *, rank: int | None = None) -> Subscription | None:
    """The subscription for vLLM's ``GET /kv_event_sources`` answer (``{rank: KVEventsConfig}``) on a server at
    ``server_host``; None when it publishes none (events off, or no such rank)."""
    if not isinstance(sources, Mapping):
        raise ConfigurationError("/kv_event_sources did not answer a JSON object")
    source = _source(sources, rank)
    if source is None:
        return None
    endpoint = str(source.get("endpoint") or "")
    if not endpoint:
        raise ConfigurationError("/kv_event_sources names no endpoint")
    replay = source.get("replay_endpoint")
    bind = not vllm_binds(endpoint)
    return Subscription(endpoint if bind else _reachable(endpoint, server_host),
                        _reachable(str(replay), server_host) if replay else None, bind, str(source.get("topic") or ""))


def from_backend(backend: Any) -> Subscription:
    """The subscription a Backend's ``kv_events`` / ``kv_events_replay`` declare: both connected to, a wildcard host
    (the server's own ``tcp://*:P``) read as the host of its ``api_base``."""
    root = getattr(backend, "server_root", None)
    host = urlsplit(root).hostname if root else None

    def reached(endpoint: str) -> str:
        parts = _host_port(endpoint)
        if parts is not None and parts[0] in _WILDCARDS and host is None:
            raise ConfigurationError(f"KV-events endpoint {endpoint!r} names no host and the backend has no api_base "
                                     "to take it from: name the server's address")
        return _reachable(endpoint, host or "")

    replay = backend.kv_events_replay
    return Subscription(reached(str(backend.kv_events)), None if replay is None else reached(str(replay)))
