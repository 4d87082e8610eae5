"""A tier of many replicas: the conversation's identity on the wire, and which replica of a pool serves it.

- :mod:`agentkv.fleet.affinity`: the routing key (an opaque digest per tenant and conversation) every request of a
  conversation carries, in the header routers read (``X-Session-ID`` by default), and which of a caller's own
  headers ride on its warms;
- :mod:`agentkv.fleet.rendezvous`: rendezvous hashing, pure: a conversation keeps its replica, and a replica leaving
  moves only its own conversations; a new conversation's home by bounded loads, and the opaque ids a shared store
  keeps replicas and tenants under;
- :mod:`agentkv.fleet.windows`: a pool's window, the smallest of its replicas'.

All pure. Which replicas are cooling off after an outage is shared state: :mod:`agentkv.state.ejections`.

    slow = Backend("hosted_vllm/big", api_base=["http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"])

See ``docs/fleet.md``.
"""

from agentkv.fleet.affinity import (DEFAULT_AFFINITY_HEADERS, affinity_missed, forwardable_headers, routing_headers,
                                    routing_key, with_routing)
from agentkv.fleet.rendezvous import (HOME_IDLE_S, HOME_MAX_ACTIVE, HOME_SLACK, HOME_TENANT_SHARE, choose, first_up,
                                      home_by_load, pool_id, ranked, store_id, tenant_cap)
from agentkv.fleet.windows import pool_window

__all__ = ["DEFAULT_AFFINITY_HEADERS", "HOME_IDLE_S", "HOME_MAX_ACTIVE", "HOME_SLACK", "HOME_TENANT_SHARE",
           "affinity_missed", "choose", "first_up", "forwardable_headers", "home_by_load", "pool_id", "pool_window",
           "ranked", "routing_headers", "routing_key", "store_id", "tenant_cap", "with_routing"]
