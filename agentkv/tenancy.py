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
    return hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()


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
