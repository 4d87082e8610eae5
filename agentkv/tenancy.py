"""Per-tenant ``cache_salt``: vLLM shares prefix-cache blocks only between requests with equal salts.

Shared prefix caches leak prompts through timing (CVE-2025-46570); a salt derived as
``HMAC-SHA256(secret, tenant)`` keeps each tenant's blocks to itself. The salt must come from a trusted
layer (the Session's configuration), never from the end user.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Mapping

from agentkv.errors import ConfigurationError

__all__ = ["CACHE_SALT_FORBIDDEN", "CACHE_SALT_MAX_CHARS", "SALT_PLACES", "cache_salt_problem", "caller_salts",
           "derive_cache_salt", "keeps_caller_salt", "resolve_cache_salt", "salts_for_tenant", "screen_caller_salts",
           "tenant_for_salt", "with_body_salt", "with_cache_salt"]


def derive_cache_salt(secret: str | bytes, tenant: str) -> str:
    """The tenant's salt: hex HMAC-SHA256 of the tenant id under ``secret``."""
    if not secret:
        raise ConfigurationError("a cache-salt secret must be non-empty")
    if not isinstance(tenant, str) or not tenant:
        raise ConfigurationError(f"a tenant id must be a non-empty string, got {tenant!r}")
    key = secret.encode() if isinstance(secret, str) else secret
    salt = hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()
    _DERIVED[salt] = tenant
    return salt


_DERIVED: dict[str, str] = {}  # salt -> tenant, for the salts this process derived (and only those)


def tenant_for_salt(salt: str | None) -> str | None:
    """The tenant this process derived ``salt`` for, or None: a salt is never guessed back to a tenant."""
    return None if salt is None else _DERIVED.get(salt)


def salts_for_tenant(tenant: str) -> set[str]:
    """Every salt this process derived for ``tenant`` (one per secret it used)."""
    return {salt for salt, owner in list(_DERIVED.items()) if owner == tenant}


def resolve_cache_salt(tenant: str | None, cache_salt: str | bool | None, secret: str | None, *,
                       self_hosted: bool) -> str | None:
    """The salt a Session sends, failing closed.

    ``cache_salt`` given as a string is the operator's override and wins, once it passes vLLM's rules
    (:func:`cache_salt_problem`; a :class:`ConfigurationError` otherwise, before anything is sent);
    ``False`` opts out explicitly (the tenant then shares the prefix cache with every other salt-less
    request: the cross-tenant timing channel of CVE-2025-46570). Otherwise a tenant with a ``secret`` gets
    HMAC(secret, tenant); a tenant on a self-hosted backend without one is refused with
    :class:`ConfigurationError` rather than sent unsalted.
    """
    if cache_salt is False:
        return None
    if isinstance(cache_salt, str):
        problem = cache_salt_problem(cache_salt)
        if problem is not None:
            raise ConfigurationError(f"Session(cache_salt=...) {problem}")
        return cache_salt
    if cache_salt is not None:
        raise ConfigurationError(f"cache_salt must be a non-empty string, False or None, got {type(cache_salt).__name__}")
    if tenant and secret:
        return derive_cache_salt(secret, tenant)
    if tenant and self_hosted:
        raise ConfigurationError(
            f"Session(tenant={tenant!r}) talks to a self-hosted backend but has no cache-salt secret, so its "
            "requests would share the prefix cache with every other tenant: pass cache_salt_secret=... or set "
            "AGENTKV_CACHE_SALT_SECRET (or cache_salt=False to share the cache knowingly)")
    return None


CACHE_SALT_MAX_CHARS = 128
"""vLLM's longest ``cache_salt`` (``vllm/entrypoints/generate/base/protocol.py``, 0.32)."""
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
"""Characters vLLM refuses in a ``cache_salt``: ``@``, ``/``, ``\\`` and NUL."""


def cache_salt_problem(salt: object) -> str | None:
    """Why vLLM would refuse ``salt`` with a 400 (as a phrase: "must be ..."), or None when it takes it.

    vLLM 0.32's rules: a non-empty string of at most 128 characters with none of ``@ / \\ NUL``. The
    phrase never quotes the salt (a salt is a capability: whoever knows it shares that cache group).
    """
    if not isinstance(salt, str) or not salt:
        return f"must be a non-empty string, got {'an empty string' if salt == '' else type(salt).__name__}"
    if len(salt) > CACHE_SALT_MAX_CHARS:
        return f"must be at most {CACHE_SALT_MAX_CHARS} characters, got {len(salt)}"
    found = sorted({char for char in salt if char in CACHE_SALT_FORBIDDEN})
    if found:
        names = ", ".join("NUL" if char == "\x00" else repr(char) for char in found)
        return f"must not contain '@', '/', '\\' or NUL, found {names}"
    return None


SALT_PLACES = ("cache_salt", "extra_body.cache_salt")
"""Where a caller's kwargs (or a raw OpenAI body) can carry a ``cache_salt`` that reaches vLLM."""


def caller_salts(kwargs: Mapping[str, Any]) -> dict[str, object]:
    """The ``cache_salt`` values a caller's kwargs carry, by place (:data:`SALT_PLACES`); None is no salt."""
    found: dict[str, object] = {}
    if kwargs.get("cache_salt") is not None:
        found["cache_salt"] = kwargs["cache_salt"]
    extra = kwargs.get("extra_body")
    if isinstance(extra, Mapping) and extra.get("cache_salt") is not None:
        found["extra_body.cache_salt"] = extra["cache_salt"]
    return found


def keeps_caller_salt(tenant: str | None, salt: str | None) -> bool:
    """Whether a caller's own ``cache_salt`` may go out: only from a Session with neither a tenant nor a salt.

    Such a Session has no isolation to keep and its caller is the operator; every other Session's salt
    comes from its tenant's derivation or the operator's ``Session(cache_salt=...)``, and a caller's is replaced.
    """
    return tenant is None and salt is None


def screen_caller_salts(kwargs: Mapping[str, Any], salt: str | None, *, keep: bool, **event: Any) -> list[str]:
    """At a request's entry, before any count or network call: the places whose caller salt will be replaced.

    ``keep`` (:func:`keeps_caller_salt`): each caller salt is checked against vLLM's rules and an
    :class:`~agentkv.errors.InvalidRequestError` names the place and the problem. Otherwise every caller salt
    that differs from the Session's ``salt`` is reported by one ``cache_salt_replaced`` warning (the places
    and whether it was replaced or removed, never a salt; ``event`` adds the session and tenant).
    """
    found = caller_salts(kwargs)
    if keep:
        for place, value in found.items():
            problem = cache_salt_problem(value)
            if problem is not None:
                from agentkv.errors import InvalidRequestError

                raise InvalidRequestError(f"{place} {problem} (vLLM would refuse the request)")
        return []
    places = [place for place, value in found.items() if value != salt]
    if places:
        from agentkv.events import emit

        emit("cache_salt_replaced", level="warning", places=places, action="removed" if salt is None else "replaced",
             reason="a salt comes only from the tenant's derivation or the operator's Session(cache_salt=...)",
             **event)
    return places


def with_cache_salt(kwargs: Mapping[str, Any], salt: str | None, *, keep_caller: bool = False) -> dict[str, Any]:
    """A copy of litellm kwargs whose only salt is ``salt``, as ``extra_body.cache_salt`` (the caller's dicts untouched).

    The Session's salt wins over any the caller put at the top level or in ``extra_body``: request bodies can
    carry end-user input, and a salt from there would let one tenant read another's cached blocks. With no
    ``salt`` the caller's are removed, unless ``keep_caller`` (:func:`keeps_caller_salt`) lets them go as they are.
    """
    out = dict(kwargs)
    if keep_caller and salt is None:
        return out
    out.pop("cache_salt", None)
    extra = out.get("extra_body")
    if salt is None and not (isinstance(extra, Mapping) and "cache_salt" in extra):
        return out
    extra = dict(extra or {})
    if salt is None:
        extra.pop("cache_salt", None)
    else:
        extra["cache_salt"] = salt
    out["extra_body"] = extra
    return out


def with_body_salt(body: Mapping[str, Any], salt: str | None, *, keep_caller: bool = False) -> dict[str, Any]:
    """A copy of a raw OpenAI request body whose ``cache_salt`` is ``salt`` (removed when None, unless
    ``keep_caller`` keeps the caller's): :func:`with_cache_salt` for bodies sent as they are."""
    out = dict(body)
    if keep_caller and salt is None:
        return out
    if salt is None:
        out.pop("cache_salt", None)
    else:
        out["cache_salt"] = salt
    return out
