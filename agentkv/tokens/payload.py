"""What a request sends to the model, and what a count of it says.

A payload has ``messages`` (chat form) or ``prompt``, never both: when a request carries both, the
messages are what the payload builder sends, so they are what is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Protocol, Sequence

from agentkv.errors import InvalidRequestError
from agentkv.events import canonical_json


class CountUnavailable(Exception):
    """A token source cannot count this payload; the counter falls back to the next source."""


@dataclass(frozen=True)
class Payload:
    """What a request sends to the model: ``messages`` (chat form) or ``prompt``, never both."""

    messages: tuple[Mapping[str, Any], ...] | None
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: Any = None
    prompt: str | None = None
    template_kwargs: Mapping[str, Any] | None = None

    def char_count(self) -> int:
        """Characters of everything counted: message text, tool calls, tool schemas."""
        return len(canonical_json(self.messages if self.messages is not None else self.prompt)) + len(
            canonical_json(self.tools or [])
        )


def detached(payload: Payload, *, deep: bool = False) -> Payload:
    """``payload`` as it is now, for comparing with a later request after the caller has edited its own message
    dicts in place (an agent truncating an old tool result): each message dict copied (its values shared:
    a reassigned ``content`` is seen, an edit inside a content list is not), or with ``deep`` every message and
    tool schema copied whole (:func:`~agentkv.tokens.incremental.snapshot`)."""
    if deep:
        from agentkv.tokens.incremental import snapshot

        return replace(payload, messages=snapshot(payload.messages), tools=snapshot(payload.tools))
    if payload.messages is None:
        return payload
    return replace(payload, messages=tuple(dict(m) if type(m) is dict else m for m in payload.messages))


def payload_from_request(kwargs: Mapping[str, Any]) -> Payload:
    """The payload of a litellm-style request: messages XOR prompt, messages winning when both exist."""
    messages = kwargs.get("messages")
    prompt = kwargs.get("prompt")
    if messages is None and prompt is None:
        raise InvalidRequestError("a request needs 'messages' (chat) or 'prompt' (completion); it had neither",
                                  field="messages")
    if messages is not None and (isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence)):
        raise InvalidRequestError(f"'messages' must be a list of message dicts, got {type(messages).__name__}",
                                  field="messages")
    tools = kwargs.get("tools")
    return Payload(
        messages=tuple(messages) if messages is not None else None,
        tools=tuple(tools) if tools else None,
        tool_choice=kwargs.get("tool_choice"),
        prompt=None if messages is not None else _prompt_text(prompt),
        template_kwargs=kwargs.get("chat_template_kwargs") or _extra_body(kwargs).get("chat_template_kwargs"),
    )


def _extra_body(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    extra = kwargs.get("extra_body")
    return extra if isinstance(extra, Mapping) else {}


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    raise InvalidRequestError(f"'prompt' must be a string or a list of strings, got {type(prompt).__name__}",
                              field="prompt")


@dataclass(frozen=True)
class TokenCount:
    """A count of one payload.

    ``total`` is the best estimate (routing uses it); ``safe`` is never below it and is what the
    output-budget clamp uses (equal to ``total`` when exact); ``tools`` is the part taken by tool
    schemas; ``source`` names the source that answered. ``low``/``high`` bound the exact count an
    estimate stands for (:attr:`interval`; both equal ``total`` when exact, ``total``/``safe`` when a
    source states no bound).
    """

    total: int
    safe: int
    tools: int
    source: str
    exact: bool
    low: int | None = None
    high: int | None = None

    @property
    def interval(self) -> tuple[int, int]:
        """``(low, high)``: the exact count lies in it (a point when exact)."""
        if self.exact:
            return self.total, self.total
        low = self.total if self.low is None else min(self.low, self.total)
        high = max(self.safe, self.total) if self.high is None else max(self.high, self.safe, self.total)
        return low, high

    @property
    def tools_share(self) -> float:
        """Share of the input taken by tool schemas."""
        return self.tools / self.total if self.total else 0.0


class TokenSource(Protocol):
    """Anything that counts a payload, or raises :class:`CountUnavailable`."""

    name: str

    def count(self, payload: Payload) -> TokenCount: ...
