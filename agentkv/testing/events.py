"""agentkv's events, captured for a test to read.

    with capture_events() as events:
        session.completion(messages=messages)
    assert any(e["event"] == "route" for e in events)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, MutableMapping

__all__ = ["capture_events"]


@contextlib.contextmanager
def capture_events() -> Iterator[list[MutableMapping[str, Any]]]:
    """Capture agentkv's structlog events as dicts (``event``, ``log_level`` and the event's fields)."""
    import structlog

    with structlog.testing.capture_logs() as events:
        yield events
