"""Value objects and request builders the Session's drivers share.

The real request and the warm-ahead request are built by the same function, so their messages,
tools, ``tool_choice``, chat-template kwargs and ``cache_salt`` are serialised the same way and the
warm's rendered prompt is a token-exact prefix of the escalated request's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from agentkv.backends import Backend
from agentkv.routing import RouteDecision
from agentkv.tenancy import with_cache_salt
from agentkv.tokens import Payload, TokenCount

# Everything that shapes the rendered prompt: a warm carries exactly these from the caller's request.
PROMPT_KEYS = ("messages", "tools", "tool_choice", "functions", "chat_template", "chat_template_kwargs",
               "add_generation_prompt", "continue_final_message", "documents", "reasoning_effort", "extra_body")
_ADDRESS_KEYS = ("model", "api_base", "base_url", "api_key")


@dataclass
class Attempt:
    """One try at sending a request: the route, the backend, the caller's kwargs and what was counted."""

    decision: RouteDecision
    backend: Backend
    kwargs: Mapping[str, Any]
    payload: Payload
    count: TokenCount
    cache_salt: str | None
    reactive_clamped: bool = False
    warm: str = ""
    handed_off: bool = False

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """The litellm kwargs for this try."""
        return request_kwargs(self.backend, self.kwargs, self.cache_salt, max_tokens=self.decision.max_tokens)


@dataclass(frozen=True)
class Observation:
    """A request accounted by :meth:`Session.observe`: its ledger turn, its count, and the route agentkv
    would have chosen (``fits`` is False when the fast backend cannot take it as it is)."""

    turn: int
    count: TokenCount
    decision: RouteDecision | None
    window: int | None
    warm: str

    @property
    def fits(self) -> bool:
        """True when the fast backend can take the request as sent (a declined reroute has a note)."""
        return self.decision is not None and self.decision.reason == "fits" and not self.decision.note


def request_kwargs(backend: Backend, kwargs: Mapping[str, Any], salt: str | None, *, max_tokens: int | None) -> dict[str, Any]:
    """The caller's kwargs addressed to ``backend``; the caller's own objects are never edited.

    Messages and tools go whole and in order, as copies (litellm may edit them in place); every other
    value is passed through as it is. ``max_tokens`` replaces the caller's budget only when routing
    clamped it, in every budget key the caller set (vLLM obeys ``max_completion_tokens`` first).
    """
    call = {k: v for k, v in kwargs.items() if k not in _ADDRESS_KEYS}
    for key in ("messages", "tools"):
        if call.get(key) is not None:
            call[key] = _copied(call[key])
    call.update(backend.litellm_kwargs())
    if max_tokens is not None:
        keys = [k for k in ("max_tokens", "max_completion_tokens") if kwargs.get(k) is not None] or ["max_tokens"]
        call.update({key: max_tokens for key in keys})
    return with_cache_salt(call, salt if backend.api_base else None)


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # an uncopyable object inside a message: pass a copy of the list, not the caller's
        return list(value)


def warm_kwargs(slow: Backend, kwargs: Mapping[str, Any], salt: str | None, timeout_s: float) -> dict[str, Any]:
    """A one-token request to ``slow`` carrying exactly what shapes the escalated request's prompt."""
    shaped = {k: kwargs[k] for k in PROMPT_KEYS if k in kwargs}
    call = request_kwargs(slow, shaped, salt, max_tokens=1)
    call["timeout"] = timeout_s
    return call


def response_cached_tokens(response: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a litellm response (or dict), when reported."""
    usage = _field(response, "usage")
    details = _field(usage, "prompt_tokens_details")
    cached = _field(details, "cached_tokens")
    return int(cached) if isinstance(cached, int) else None


def _field(obj: Any, name: str) -> Any:
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

    def __init__(self, stream: Any, on_usage: Any) -> None:
        self._stream = stream
        self._on_usage = on_usage
        self._reported = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _see(self, chunk: Any) -> Any:
        if not self._reported and _field(chunk, "usage") is not None:
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
