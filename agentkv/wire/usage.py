"""Reading what a backend answered: its usage and finish reason, a stream that reports them, and what they say.

:func:`server_clamped` is the pure reading of a silent server clamp: vLLM 0.32 no longer rejects a prompt
plus ``max_tokens`` over its window, it cuts the budget and answers 200 with ``finish_reason: "length"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["StreamWatcher", "Usage", "read_field", "response_cache_writes", "response_cached_tokens", "response_usage",
           "server_clamped"]


@dataclass(frozen=True)
class Usage:
    """What an answer reported: its ``usage`` counts (None where absent) and its first choice's finish reason."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    cache_write_tokens: int | None = None  # what a hosted provider wrote to its prompt cache (None: not reported)


def response_usage(response: Any, *, finish_reason: str | None = None) -> Usage:
    """The :class:`Usage` of a litellm response, an OpenAI JSON answer or a stream's usage chunk (a dict or an
    object); ``finish_reason`` is used when the answer carries none (a stream reports it in an earlier chunk)."""
    usage = read_field(response, "usage")
    return Usage(_int(read_field(usage, "prompt_tokens")), _int(read_field(usage, "completion_tokens")),
                 response_cached_tokens(response), first_finish_reason(response) or finish_reason,
                 response_cache_writes(response))


def response_cached_tokens(response: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a litellm response (or dict), when reported; Anthropic's
    ``cache_read_input_tokens`` where litellm gives only that."""
    usage = read_field(response, "usage")
    details = read_field(usage, "prompt_tokens_details")
    cached = _int(read_field(details, "cached_tokens"))
    return cached if cached is not None else _int(read_field(usage, "cache_read_input_tokens"))


def response_cache_writes(response: Any) -> int | None:
    """The tokens a hosted provider wrote to its prompt cache for this answer: Anthropic's
    ``cache_creation_input_tokens``, OpenAI's ``prompt_tokens_details.cache_write_tokens``; None when unreported."""
    usage = read_field(response, "usage")
    for value in (read_field(usage, "cache_creation_input_tokens"),
                  read_field(read_field(usage, "prompt_tokens_details"), "cache_write_tokens"),
                  read_field(read_field(usage, "prompt_tokens_details"), "cache_creation_tokens")):
        if _int(value) is not None:
            return _int(value)
    return None


def first_finish_reason(response: Any) -> str | None:
    """The first choice's ``finish_reason`` (None when absent: a usage-only stream chunk has no choices)."""
    choices = read_field(response, "choices")
    if not isinstance(choices, (list, tuple)) or not choices:
        return None
    reason = read_field(choices[0], "finish_reason")
    return reason if isinstance(reason, str) else None


def server_clamped(usage: Usage, sent_max_tokens: int | None) -> bool:
    """True when the server cut the output budget it was sent: it finished on ``"length"`` having produced
    fewer completion tokens than ``sent_max_tokens`` (None: no budget was sent, so nothing was cut)."""
    return (sent_max_tokens is not None and usage.finish_reason == "length" and usage.completion_tokens is not None
            and usage.completion_tokens < sent_max_tokens)


def read_field(obj: Any, name: str) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` otherwise; None when absent (litellm objects or dicts)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class StreamWatcher:
    """Wraps a litellm stream (sync or async), passing every chunk through unchanged.

    When a chunk carries ``usage`` (``stream_options={"include_usage": True}``), its :class:`Usage` (with the
    finish reason an earlier chunk gave) is handed to ``on_usage`` once; every other attribute is the wrapped
    stream's.
    """

    def __init__(self, stream: Any, on_usage: Callable[[Usage], None]) -> None:
        self._stream = stream
        self._on_usage = on_usage
        self._reported = False
        self._finish_reason: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _see(self, chunk: Any) -> Any:
        if not self._reported:
            self._finish_reason = first_finish_reason(chunk) or self._finish_reason
            if read_field(chunk, "usage") is not None:
                self._reported = True
                self._on_usage(response_usage(chunk, finish_reason=self._finish_reason))
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
