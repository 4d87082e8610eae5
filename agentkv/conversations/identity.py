"""Which conversation a request belongs to: there is one Session per conversation, and cooldowns are keyed by it.

The gateway and :class:`~agentkv.Conversations` both ask this. In order: an explicit id (the gateway's
``x-session-id`` header; an integration's header, LangGraph's ``thread_id`` or litellm's ``metadata``); else the
request's ``user`` field; else a fingerprint of the conversation's opening, which every later turn repeats: the system
(and developer) messages before the first user message, that message, and the tool schemas. The fingerprint is
SHA-256 over canonical JSON, so every process computes the same one and a client that sends nothing special still gets
one warm per conversation. A text completion's opening is the first :data:`PROMPT_OPENING` characters of its prompt.
The tenant scopes all three: the Session map is keyed by ``(tenant, conversation)`` and the Session carries the
tenant, which is never read from the request itself.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from agentkv.events import canonical_json

__all__ = ["PROMPT_OPENING", "conversation_id", "fingerprint", "opening_messages", "session_id"]

PROMPT_OPENING = 2048
"""Characters of a text completion's prompt that identify its conversation."""
_SYSTEM_ROLES = ("system", "developer")
_MAX_ID = 256


def conversation_id(header: str | None, body: Mapping[str, Any]) -> str:
    """The conversation's id: ``h:<header>`` (an explicit id), ``u:<user>`` or ``f:<fingerprint>`` (ids are cut at
    256 chars)."""
    if header and header.strip():
        return "h:" + header.strip()[:_MAX_ID]
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user[:_MAX_ID]
    return "f:" + fingerprint(body)


def fingerprint(body: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the conversation's opening: the system messages, the first user message, the tool schemas."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        prompt = body.get("prompt")
        opening: Any = {"prompt": (prompt if isinstance(prompt, str) else canonical_json(prompt))[:PROMPT_OPENING]}
    else:
        system, first_user = opening_messages(messages)
        opening = {"system": system, "user": first_user, "tools": body.get("tools") or []}
    return hashlib.sha256(canonical_json(opening).encode()).hexdigest()


def opening_messages(messages: list[Any]) -> tuple[list[Any], Any]:
    """The contents of the system (and developer) messages before the first user message, and that message's
    (None without one): what every later turn of the conversation repeats, whatever is appended."""
    system: list[Any] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            return system, message.get("content")
        if role in _SYSTEM_ROLES:
            system.append(message.get("content"))
    return system, None


def session_id(conversation: str) -> str:
    """The Session id of a conversation: a digest, the same in every process (a client's id never reaches a log)."""
    return "gw-" + hashlib.sha256(conversation.encode()).hexdigest()[:32]
