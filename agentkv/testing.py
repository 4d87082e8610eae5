"""Helpers for testing agents that use agentkv: a fake clock, event capture, embedded servers.

    from agentkv.testing import FakeClock, capture_events, embedded_servers

    with embedded_servers() as (fast, slow):          # two vLLM-compatible servers on 127.0.0.1
        with capture_events() as events:
            ...
        assert any(e["event"] == "route" for e in events)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class FakeClock:
    """A monotonic clock that moves only when told: pass it as ``timer=``/``clock=``."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


@contextlib.contextmanager
def capture_events() -> Iterator[list[dict[str, Any]]]:
    """Capture agentkv's structlog events as dicts (``event``, ``log_level`` and the event's fields)."""
    import structlog

    with structlog.testing.capture_logs() as events:
        yield events


@contextlib.contextmanager
def embedded_servers(
    fast_size: str = "small",
    slow_size: str = "large",
    *,
    fast_window: int = 2048,
    slow_window: int = 16384,
    **server_kwargs: Any,
) -> Iterator[tuple[Any, Any]]:
    """Start two embedded vLLM-compatible servers on free loopback ports; stop them on exit.

    Yields ``(fast_server, slow_server)``; each has ``api_base``, ``model_id`` and ``backend()``.
    """
    from agentkv.local.server import LocalServer

    fast = LocalServer.from_size(fast_size, window=fast_window, **server_kwargs)
    slow = LocalServer.from_size(slow_size, window=slow_window, **server_kwargs)
    with fast, slow:
        yield fast, slow


class ScriptedReplies:
    """A litellm-compatible client for agent tests whose model has random weights.

    Each request goes out for real through litellm (token counts, windows, cache hits stay real);
    then the reply's message is replaced by the script's next step: a string is a final answer, a list
    of ``(name, json_arguments)`` pairs is a turn of tool calls. Warm-ahead requests (``max_tokens=1``)
    and requests past the end of the script pass through untouched.

        client = ScriptedReplies([[("search", '{"q": "disk"}')], "It was compaction."])
        Session(fast, slow, client=client).run("why?", tools={"search": search})
    """

    def __init__(self, script: list[Any]) -> None:
        from agentkv._env import import_litellm

        self.litellm = import_litellm()
        self.script = list(script)

    def _replace(self, response: Any, kwargs: dict[str, Any]) -> Any:
        if kwargs.get("max_tokens") == 1 or not self.script:
            return response
        step = self.script.pop(0)
        if isinstance(step, str):
            response.choices[0].message = self.litellm.Message(content=step)
        else:
            response.choices[0].message = self.litellm.Message(content="", tool_calls=[
                {"id": f"call_{len(self.script)}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(step)])
        return response

    def completion(self, **kwargs: Any) -> Any:
        return self._replace(self.litellm.completion(**kwargs), kwargs)

    async def acompletion(self, **kwargs: Any) -> Any:
        return self._replace(await self.litellm.acompletion(**kwargs), kwargs)
