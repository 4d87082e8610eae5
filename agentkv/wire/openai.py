"""OpenAI's chat and text completions on the wire: the raw bodies a try sends, and what is read from the answers.

Used alike by the OpenAI-SDK transport (:mod:`agentkv.integrations.openai`) and the gateway
(:mod:`agentkv.gateway.relay`), which both take a client's raw body and send it on through the Session's loop:

- :func:`counted_view`: what the Session counts and warms of a body (without its streaming switches);
- :func:`outgoing_body` / :func:`endpoint_url`: one try's body and URL for the attempt's backend;
- :class:`Rejected`: a backend's error answer (status >= 400) as the error the retry policy and the overflow parser
  read;
- :class:`UsageWatch`: the last ``usage`` chunk of an SSE stream, read as the bytes pass (linear, bounded).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from agentkv.fleet import routing_headers
from agentkv.tenancy import with_body_salt
from agentkv.wire.hosted import openai_keyed

if TYPE_CHECKING:
    import httpx

    from agentkv.backends import Backend
    from agentkv.routing import RouteDecision

__all__ = ["NOT_COUNTED", "OBSERVED_KEYS", "Rejected", "UsageWatch", "counted_view", "endpoint_url",
           "outgoing_body", "routing_headers_of", "try_bytes"]

NOT_COUNTED = ("stream", "stream_options")
"""Keys of a body that shape neither the prompt nor the budget: not counted, not warmed."""

OBSERVED_KEYS = ("tools", "tool_choice", "max_tokens", "max_completion_tokens")
"""What an observer (a LangChain callback, a litellm logger) passes to ``Session.observe`` besides messages."""

_BUDGET_KEYS = ("max_tokens", "max_completion_tokens")


class Attempt(Protocol):
    """What a try's wire form is made of (an :class:`agentkv.Attempt` is one): its route, its backend, the caller's
    kwargs as the Session holds them, the salt, the KV export it names, the conversation's routing key and the raw
    request's own headers."""

    @property
    def decision(self) -> "RouteDecision": ...
    @property
    def backend(self) -> "Backend": ...
    @property
    def kwargs(self) -> Mapping[str, Any]: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def keeps_caller_salt(self) -> bool: ...
    @property
    def handoff_export(self) -> str | None: ...
    @property
    def text(self) -> bool: ...
    @property
    def routing_key(self) -> str | None: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


def counted_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the Session counts and warms: the body without its streaming switches."""
    return {k: v for k, v in body.items() if k not in NOT_COUNTED}


def outgoing_body(body: Mapping[str, Any], attempt: Attempt) -> dict[str, Any]:
    """The body for this try: the slow model's id when routed there, the clamped budget, the attempt's salt
    (replacing the caller's: :func:`agentkv.tenancy.with_body_salt`) and the handoff's import when it named one."""
    out = dict(body)
    if attempt.decision.role == "slow":
        out["model"] = attempt.backend.served_model
    budget = attempt.decision.max_tokens
    if budget is not None:
        keys = [k for k in _BUDGET_KEYS if body.get(k) is not None] or ["max_tokens"]
        out.update({key: budget for key in keys})
    if attempt.handoff_export is not None:  # the escalated request names slow's import: top level on the wire
        named = attempt.kwargs.get("kv_transfer_params") or (attempt.kwargs.get("extra_body") or {}).get(
            "kv_transfer_params")
        out["kv_transfer_params"] = named
    if attempt.backend.affinity_user and attempt.routing_key is not None and out.get("user") is None:
        out["user"] = attempt.routing_key
    if attempt.backend.provider_kind == "openai":  # OpenAI's API: its prompt cache routed by the conversation
        out = openai_keyed(out, routing_key=attempt.routing_key, retention=attempt.backend.cache_retention)
    hosted = not attempt.backend.self_hosted  # no hosted API takes a salt, the caller's own neither
    return with_body_salt(out, None if hosted else attempt.cache_salt, keep_caller=attempt.keeps_caller_salt and not hosted)


def routing_headers_of(attempt: Attempt) -> dict[str, str]:
    """The headers this try carries besides the body's: the conversation's routing key under the backend's affinity
    header names (a raw request's own headers, which its sender passes on itself, win)."""
    return routing_headers(attempt.backend, attempt.routing_key, attempt.headers) if attempt.routing_key else {}


def endpoint_url(attempt: Attempt) -> str:
    """The endpoint of this try: the backend's ``/chat/completions``, or ``/completions`` for a text completion."""
    base = (attempt.backend.api_base or "").rstrip("/")
    return f"{base}/completions" if attempt.text else f"{base}/chat/completions"


def try_bytes(body: Mapping[str, Any], attempt: Attempt) -> bytes:
    """This try's JSON: the client's body addressed to the attempt's backend (whatever ``model`` it named)."""
    return json.dumps(outgoing_body({**body, "model": attempt.backend.served_model}, attempt)).encode()


class Rejected(Exception):
    """A backend's error answer (any status >= 400), read whole: shaped like the SDK's ``APIStatusError`` for the
    overflow parser and the retry policy (``status_code``, ``message``); ``raw`` is the answer's body as it came
    and ``response`` its head, when the sender has one."""

    def __init__(self, status_code: int, text: str, response: "httpx.Response | None" = None, raw: bytes = b"") -> None:
        super().__init__(text)
        self.status_code = status_code
        self.message = text
        self.response, self.raw = response, raw

    @classmethod
    def of(cls, status_code: int, raw: bytes, response: "httpx.Response | None" = None) -> "Rejected":
        """The error for an answer with ``status_code`` and body ``raw``."""
        return cls(status_code, raw.decode("utf-8", "replace"), response, raw)


class UsageWatch:
    """Reads SSE lines as they pass and keeps the last chunk that carries ``usage``.

    Linear in the bytes fed, and bounded: a line is held only until its newline arrives, and a line longer than
    ``max_line`` bytes (1 MiB; a usage chunk is a few hundred) is dropped as it grows, not held.
    """

    def __init__(self, max_line: int = 1 << 20) -> None:
        self.max_line = max_line
        self._parts: list[bytes] = []  # the current line's pieces (joined once, at its newline)
        self._held = 0
        self._skipping = False  # the current line grew past max_line: dropped up to its newline
        self.usage_chunk: dict[str, Any] = {}

    def feed(self, data: bytes) -> None:
        """Take the next raw bytes of the stream."""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._hold(data[start:end])
            if not self._skipping:
                self._line(b"".join(self._parts).strip())
            self._parts, self._held, self._skipping = [], 0, False
            start = end + 1
        self._hold(data[start:])

    def _hold(self, piece: bytes) -> None:
        if self._skipping or not piece:
            return
        self._held += len(piece)
        if self._held > self.max_line:
            self._parts, self._held, self._skipping = [], 0, True
        else:
            self._parts.append(piece)

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return
        try:
            chunk = json.loads(line[5:])
        except (ValueError, RecursionError):
            return
        if isinstance(chunk, dict) and chunk.get("usage"):
            self.usage_chunk = chunk
