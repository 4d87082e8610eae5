"""Structured events: sizes and hashes, never prompt text unless ``AGENTKV_LOG_PROMPTS=1``."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def logger() -> Any:
    """agentkv's structlog logger, looked up at call time so test capture and user config apply."""
    import structlog

    return structlog.get_logger("agentkv")


def digest(value: Any, length: int = 12) -> str:
    """A short stable sha256 of any JSON-able value (or str/bytes), for logs and cache keys."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    else:
        data = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def emit(event: str, level: str = "info", **fields: Any) -> None:
    """Log one agentkv event at ``level`` with plain-data fields."""
    getattr(logger(), level)(event, **fields)
