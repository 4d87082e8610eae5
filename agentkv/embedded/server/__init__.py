"""vLLM's OpenAI-compatible HTTP API over a :class:`~agentkv.embedded.engine.LocalEngine`.

The ASGI app (``asgi``), the server object and its lifecycle (``local_server``), what each endpoint does without
sockets (``routes``; chat and completions in ``chat``, ``completions`` and ``prompts``; tool calls in ``tools``),
request models and checks (``requests``, ``request_errors``, ``validation``), response shapes (``protocol``),
``/metrics`` (``metrics``), vLLM's KV-event publisher (``kv_events``) and ``agentkv serve`` (``serve_cli``).
This package depends on :mod:`agentkv.embedded.engine`; the engine never imports it.

Usage::

    from agentkv.embedded.server import LocalServer

    with LocalServer.from_size("small", window=2048) as server:
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv._support.lazy import lazy_exports

if TYPE_CHECKING:
    from agentkv.embedded.server.local_server import LocalServer, LoggedRequest, engine_at

_EXPORTS = {name: "agentkv.embedded.server.local_server" for name in ("LocalServer", "LoggedRequest", "engine_at")}

__all__ = ["LocalServer", "LoggedRequest", "engine_at"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
