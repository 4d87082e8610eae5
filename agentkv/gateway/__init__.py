"""The OpenAI-compatible gateway: every agent, in any language, gets routing, warm-ahead and tenant isolation by
changing its base URL (``agentkv gateway``; see ``docs/gateway.md``).

- :mod:`.config`: :class:`GatewayConfig`, the flags and the limits the environment sets;
- :mod:`.app`: the ASGI app: the routed POSTs on plain ASGI (the body limit, the reply and the disconnect watcher of
  :mod:`agentkv.http.asgi`; bad input) and, on Starlette, the other routes;
- :mod:`.relay`: one request through the Session's public core (``aprepare`` / ``aturn`` / ``answered``);
- :mod:`.context`: a process's shared state: backends, state store, Sessions, upstream client, metrics;
- :mod:`.sessions`: the bounded map of conversations (LRU plus idle TTL);
- :mod:`.identity`: which conversation a request belongs to;
- :mod:`.auth`: API keys to tenants, and the secret their salts derive from;
- :mod:`.metrics`: Prometheus metrics; :mod:`.replies`: OpenAI's error shape and the route headers;
- :mod:`.serve`: uvicorn in the foreground (``--workers``) or in a thread (:class:`GatewayThread`); :mod:`.cli`.

Importing this package is cheap: starlette, uvicorn and prometheus_client load with :func:`create_app`.
"""

from __future__ import annotations

from agentkv._support.lazy import lazy_exports
from agentkv.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "GatewayThread", "create_app"]


__getattr__, __dir__ = lazy_exports(__name__, {"create_app": "agentkv.gateway.app",
                                                 "GatewayThread": "agentkv.gateway.serve"}, globals(), __all__)
