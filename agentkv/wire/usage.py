"""Reading what a backend answered: its usage and finish reason, a stream that reports them, and what they say.

Usage figures are data from a server, so they are checked where they are read (:func:`token_figure`): a count that
is not an integer (a float, a string, a bool, NaN), is negative, or is past :data:`MAX_REPORTED_TOKENS` is read as
absent, and the :class:`Usage` names it in :attr:`Usage.rejected` (field and reason, never the value), for the
driver to report (:func:`report_rejected`). Nothing downstream (stats, costs, the ledger, the count bound) ever
sees a bad figure, and the answer itself is handed on as it came.

:func:`server_clamped` is the pure reading of a silent server clamp: vLLM 0.32 no longer rejects a prompt
plus ``max_tokens`` over its window, it cuts the budget and answers 200 with ``finish_reason: "length"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from agentkv.events import emit

__all__ = ["MAX_REPORTED_TOKENS", "StreamWatcher", "Usage", "read_field", "report_rejected", "response_cache_writes",
           "response_cached_tokens", "response_usage", "server_clamped", "token_figure"]

# No answer's token count past this is believed (a window of 2 billion tokens is far past any model's).
MAX_REPORTED_TOKENS = 2 ** 31


@dataclass(frozen=True)
class Usage:
    """What an answer reported: its ``usage`` counts (None where absent or refused) and its first choice's finish
    reason; ``rejected``: the ``(field, reason)`` of each count refused (:func:`token_figure`)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    cache_write_tokens: int | None = None  # what a hosted provider wrote to its prompt cache (None: not reported)
    rejected: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # how it was read, not what it says


def token_figure(value: Any) -> tuple[int | None, str | None]:
    """``(value, None)`` for a token count to believe: an integer from 0 to :data:`MAX_REPORTED_TOKENS`;
    ``(None, None)`` for an absent one; ``(None, why)`` for one refused ("not an integer", "negative",
    "past the bound")."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int):
        return None, "not an integer"
    if value < 0:
        return None, "negative"
    if value > MAX_REPORTED_TOKENS:
        return None, "past the bound"
    return value, None


class _Reading:
    """One answer's ``usage`` read field by field, keeping the figures refused (by dotted name)."""

    def __init__(self, response: Any) -> None:
        self.usage = read_field(response, "usage")
        self.rejected: list[tuple[str, str]] = []

    def figure(self, *path: str) -> int | None:
        value: Any = self.usage
        for name in path:
            value = read_field(value, name)
        figure, why = token_figure(value)
        if why is not None:
            self.rejected.append((".".join(("usage", *path)), why))
        return figure

    def first(self, *paths: tuple[str, ...]) -> int | None:
        """The first of ``paths`` that holds a believable figure (each one read, so each refusal is kept)."""
        found = [self.figure(*path) for path in paths]
        return next((f for f in found if f is not None), None)

    def cached(self) -> int | None:
        return self.first(("prompt_tokens_details", "cached_tokens"), ("cache_read_input_tokens",))

    def writes(self) -> int | None:
        return self.first(("cache_creation_input_tokens",), ("prompt_tokens_details", "cache_write_tokens"),
                          ("prompt_tokens_details", "cache_creation_tokens"))


def response_usage(response: Any, *, finish_reason: str | None = None) -> Usage:
    """The :class:`Usage` of a litellm response, an OpenAI JSON answer or a stream's usage chunk (a dict or an
    object); ``finish_reason`` is used when the answer carries none (a stream reports it in an earlier chunk).
    Pure: a refused figure is None here and named in :attr:`Usage.rejected`."""
    reading = _Reading(response)
    prompt, completion = reading.figure("prompt_tokens"), reading.figure("completion_tokens")
    cached, writes = reading.cached(), reading.writes()
    return Usage(prompt, completion, cached, first_finish_reason(response) or finish_reason, writes,
                 tuple(dict.fromkeys(reading.rejected)))


def response_cached_tokens(response: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a litellm response (or dict), when reported; Anthropic's
    ``cache_read_input_tokens`` where litellm gives only that (None where neither is a believable figure)."""
    return _Reading(response).cached()


def response_cache_writes(response: Any) -> int | None:
    """The tokens a hosted provider wrote to its prompt cache for this answer: Anthropic's
    ``cache_creation_input_tokens``, OpenAI's ``prompt_tokens_details.cache_write_tokens``; None when unreported."""
    return _Reading(response).writes()


def report_rejected(usage: Usage, **where: Any) -> None:
    """One ``usage_rejected`` warning per figure :func:`response_usage` refused: its field and the reason, with
    ``where`` (backend, session...); never the value, which may be megabytes of digits."""
    for name, reason in usage.rejected:
        emit("usage_rejected", level="warning", field=name, reason=reason, **where)


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
