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

    ``cache_salt`` given as a string wins; ``False`` opts out explicitly (the tenant then shares the
    prefix cache with every other salt-less request: the cross-tenant timing channel of CVE-2025-46570).
    Otherwise a tenant with a ``secret`` gets HMAC(secret, tenant); a tenant on a self-hosted backend
    without one is refused with :class:`ConfigurationError` rather than sent unsalted.
    """
    if cache_salt is False:
        return None
    if isinstance(cache_salt, str) and cache_salt:
        return cache_salt
    if cache_salt is not None:
        raise ConfigurationError(f"cache_salt must be a non-empty string, False or None, got {cache_salt!r}")
    if tenant and secret:
        return derive_cache_salt(secret, tenant)
    if tenant and self_hosted:
        raise ConfigurationError(
            f"Session(tenant={tenant!r}) talks to a self-hosted backend but has no cache-salt secret, so its "
            "requests would share the prefix cache with every other tenant: pass cache_salt_secret=... or set "
            "AGENTKV_CACHE_SALT_SECRET (or cache_salt=False to share the cache knowingly)")
    return None


def with_cache_salt(kwargs: Mapping[str, Any], salt: str | None) -> dict[str, Any]:
    """A copy of litellm kwargs whose ``extra_body`` carries ``cache_salt`` (the caller's dicts untouched).

    The tenant's salt wins over one found in ``extra_body``: request bodies can carry end-user input,
    and a salt from there would let one tenant read another's cached blocks. A replaced salt is logged.
    """
    out = dict(kwargs)
    if salt is None:
        return out
    extra = dict(out.get("extra_body") or {})
    if extra.get("cache_salt") not in (None, salt):
        from agentkv.events import emit

        emit("cache_salt_replaced", level="warning", reason="the tenant's salt overrides extra_body.cache_salt")
    extra["cache_salt"] = salt
    out["extra_body"] = extra
    return out
