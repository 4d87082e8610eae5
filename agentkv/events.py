"""Structured events: sizes and hashes, never prompt text unless ``AGENTKV_LOG_PROMPTS=1``."""

from __future__ import annotations

import asyncio
import hashlib
import json
from contextvars import ContextVar
from typing import Any

_DEFERRED: ContextVar[bool] = ContextVar("agentkv_events_deferred", default=False)


def logger() -> Any:
    """agentkv's structlog logger, looked up at call time so test capture and user config apply."""
    import structlog

    return structlog.get_logger("agentkv")


def canonical_json(value: Any) -> str:
    """One canonical JSON text for any value (sorted keys, no ASCII escaping); a str is itself."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def digest(value: Any, length: int = 12) -> str:
    """A short stable sha256 of any JSON-able value (or str/bytes), for logs and cache keys."""
    data = value if isinstance(value, bytes) else canonical_json(value).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def enabled(level: str = "info") -> bool:
    """False only when agentkv's logger drops ``level`` events before any processor sees them (structlog's
    filtering loggers, ``make_filtering_bound_logger``, turn a level below theirs into a no-op named
    ``_nop``): an event's costly fields need not be computed then. True whenever that is not certain."""
    import structlog

    try:
        method = getattr(structlog.get_config()["wrapper_class"], level)  # the class logger() binds
    except Exception:  # pragma: no cover - an unusual logger: assume it logs
        return True
    return getattr(method, "__name__", "") != "_nop"


def emit(event: str, level: str = "info", **fields: Any) -> None:
    """Log one agentkv event at ``level`` with plain-data fields (off the request path under :func:`defer_events`)."""
    if _DEFERRED.get():
        try:
            asyncio.get_running_loop().call_soon(_log, event, level, fields)
            return
        except RuntimeError:  # no loop running in this thread: log now
            pass
    getattr(logger(), level)(event, **fields)


def _log(event: str, level: str, fields: dict[str, Any]) -> None:
    getattr(logger(), level)(event, **fields)


def defer_events() -> None:
    """From now on in this context (an async request's task and the tasks it starts), events are logged by the
    event loop's next turn instead of at the call: in order, with the same context, but after the request has
    moved on to its next await (a server's request path logs while it waits for its backend, not before)."""
    _DEFERRED.set(True)


def prompt_fields(payload: Any) -> dict[str, Any]:
    """What an event may say about a prompt: its size and hash; its last message only when
    ``AGENTKV_LOG_PROMPTS=1`` (off by default)."""
    if payload is None or payload.messages is None:
        return {}
    messages = list(payload.messages)
    fields: dict[str, Any] = {"messages": len(messages), "prompt_hash": digest([messages, payload.tools])}
    from agentkv._support.env import log_prompts

    if log_prompts() and messages:
        fields["last_message"] = str(messages[-1].get("content"))[:500]
    return fields
