"""A conversation's identity on the wire: the routing key every request of a conversation carries, and which of a
caller's own headers may ride on the requests agentkv sends for it (its warms): an allow-list, never a deny-list.

Routers keep a conversation on one replica when each of its requests carries the same session key: the vLLM router's
``consistent_hash`` reads ``X-Session-ID`` (then ``user``), llm-d a configured ``session_id_header``, the production
stack's router ``--session-key``. agentkv sends the key on turns, warms, recoveries, failovers and handoff exports
alike, so a warm lands where its escalation will. Routers log headers: the key is an opaque digest of the tenant and
the conversation, never either of them.

    key = routing_key("acme", "conversation-7", secret=b"...")   # 32 hex characters
    routing_headers(backend, key, caller={"X-Session-ID": "theirs"})   # the caller's own key wins

A warm repeats only the caller's headers the backend names: its ``affinity_headers`` and its ``forward_headers``
(``Backend(forward_headers=("X-Route-Hint",))``). No list of forbidden names can know every credential header
(``X-Goog-IAP-JWT-Assertion``, ``X-Forwarded-Client-Cert``, a header called ``Bearer``), so none is kept.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from agentkv.backends import Backend

__all__ = ["DEFAULT_AFFINITY_HEADERS", "affinity_missed", "forwardable_headers", "routing_headers", "routing_key",
           "with_routing"]

DEFAULT_AFFINITY_HEADERS = ("X-Session-ID",)

_MAX_FORWARDED = 32  # headers, and 8 KiB of them: whatever a caller sends, a warm carries a bounded set
_MAX_FORWARDED_BYTES = 8192
_KEY_DOMAIN = b"agentkv-routing-key-v1"


def routing_key(tenant: str | None, session_id: str, secret: str | bytes | None = None) -> str:
    """The conversation's routing key: 32 hex characters of a keyed BLAKE2b over the tenant and the session id.

    The same inputs give the same key in every process (two gateways route a conversation alike); ``secret`` (the
    cache-salt secret, when one is configured) makes the key unguessable from a session id as well."""
    key = secret.encode() if isinstance(secret, str) else (secret or b"")
    digest = hashlib.blake2b(digest_size=16, key=key[:64] or _KEY_DOMAIN, person=b"agentkv-route")
    digest.update((tenant or "").encode("utf-8", "surrogatepass") + b"\0" + session_id.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def forwardable_headers(headers: Mapping[str, Any] | None, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """The caller's headers a warm repeats so that it lands where the caller's own turn lands: only the string
    headers named in ``allowed`` (case-insensitive: a backend's affinity and forward headers, :func:`routing_headers`),
    at most 32 of them and 8 KiB in all. Nothing else, whatever it is called."""
    kept: dict[str, str] = {}
    size = 0
    named = {name.lower() for name in allowed}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str) or name.lower() not in named:
            continue
        if len(kept) >= _MAX_FORWARDED or size + len(name) + len(value) > _MAX_FORWARDED_BYTES:
            continue  # one large header never crowds out a later one that fits (a session header among them)
        size += len(name) + len(value)
        kept[name] = value
    return kept


def routing_headers(backend: Backend, key: str | None, caller: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The headers a request to ``backend`` carries: the caller's headers the backend names (its ``affinity_headers``
    and ``forward_headers``), then ``key`` under each affinity header name the caller did not set itself (a caller's
    own session header wins)."""
    headers = forwardable_headers(caller, backend.affinity_headers + backend.forward_headers)
    if key is None:
        return headers
    taken = {name.lower() for name in headers}
    for name in backend.affinity_headers:
        if name.lower() not in taken:
            headers[name] = key
    return headers


def with_routing(call: dict[str, Any], backend: Backend, key: str | None) -> dict[str, Any]:
    """A litellm call's kwargs with the routing key added: in ``extra_headers`` (the caller's own ``extra_headers``
    are kept whole, and a session header of theirs wins) and, when the backend opts in, as ``user`` (unless set)."""
    if key is None:
        return call
    given = call.get("extra_headers")
    given = dict(given) if isinstance(given, Mapping) else {}
    taken = {str(name).lower() for name in given}
    added = {name: key for name in backend.affinity_headers if name.lower() not in taken}
    if added:
        call["extra_headers"] = {**given, **added}
    if backend.affinity_user and call.get("user") is None:
        call["user"] = key
    return call


def affinity_missed(expected: int | None, cached: int | None, *, floor: int = 256, ratio: float = 0.5) -> bool:
    """Whether a slow turn's ``cached`` tokens fall far below the ``expected`` prefix (the previous slow turn's
    prompt, or what the warm before an escalation sent): under ``ratio`` of it, when it is at least ``floor`` tokens
    (below that, block rounding and short prompts say nothing). A router that moved the conversation, or a replica
    that restarted or evicted it, looks like this."""
    return expected is not None and cached is not None and expected >= floor and cached < ratio * expected
