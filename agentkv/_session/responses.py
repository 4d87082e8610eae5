"""Reading what a backend answered: cached tokens from a response, and a stream that reports its usage."""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["StreamWatcher", "read_field", "response_cached_tokens"]


def response_cached_tokens(response: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a litellm response (or dict), when reported."""
    usage = read_field(response, "usage")
    details = read_field(usage, "prompt_tokens_details")
    cached = read_field(details, "cached_tokens")
    return int(cached) if isinstance(cached, int) else None


def read_field(obj: Any, name: str) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` otherwise; None when absent (litellm objects or dicts)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


class StreamWatcher:
    """Wraps a litellm stream (sync or async), passing every chunk through unchanged.

    When a chunk carries ``usage`` (``stream_options={"include_usage": True}``), its cached tokens are
    handed to ``on_usage`` once; every other attribute is the wrapped stream's.
    """

    def __init__(self, stream: Any, on_usage: Callable[[int | None], None]) -> None:
        self._stream = stream
        self._on_usage = on_usage
        self._reported = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _see(self, chunk: Any) -> Any:
        if not self._reported and read_field(chunk, "usage") is not None:
            self._reported = True
            self._on_usage(response_cached_tokens(chunk))
        return chunk

    def __iter__(self) -> "StreamWatcher":
        return self

    def __next__(self) -> Any:
        return self._see(next(self._iter()))

    def _iter(self) -> Any:
        if not hasattr(self, "_sync_it"):
            self._sync_it = iter(self._stream)
        return self._sync_it

    def __aiter__(self) -> "StreamWatcher":
        return self

    async def __anext__(self) -> Any:
        if not hasattr(self, "_async_it"):
            self._async_it = self._stream.__aiter__()
        return self._see(await self._async_it.__anext__())
