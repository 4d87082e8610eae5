"""Who is asking: an API key names a tenant, and the tenant's ``cache_salt`` derives from a secret, never the key.

The keys file is a JSON object ``{"<api key>": {"tenant": "<tenant>"}}``. Only SHA-256 digests of the keys
are kept once it is read, and a request's key is looked up by its digest. Salts are the library's
(:func:`agentkv.derive_cache_salt`): HMAC-SHA256 of the tenant under ``AGENTKV_CACHE_SALT_SECRET``. Where that
is unset and a keys file is given, the secret is a digest of the file's bytes: replicas that share the file
derive the same salts, and no salt can be computed without every key in it. Without a keys file every
request is the anonymous tenant's, salted when a secret is set.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from agentkv.errors import ConfigurationError

__all__ = ["ANONYMOUS", "ApiKeys", "bearer_token", "load_api_keys", "salt_secret"]

ANONYMOUS = "anonymous"
"""The tenant of every request when the gateway has no keys file."""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    """The tenants by key digest, and the digest of the file they came from."""

    tenants: Mapping[str, str]
    file_digest: str

    def tenant(self, key: str | None) -> str | None:
        """The tenant of ``key``, or None for a missing or unknown key."""
        return None if not key else self.tenants.get(_digest(key))


def parse_api_keys(data: Any) -> dict[str, str]:
    """``{key digest: tenant}`` from the parsed file, or :class:`ConfigurationError` naming what is wrong."""
    if not isinstance(data, dict) or not data:
        raise ConfigurationError('--api-keys must hold a non-empty JSON object {"<key>": {"tenant": "<tenant>"}}')
    tenants: dict[str, str] = {}
    for number, (key, entry) in enumerate(data.items(), 1):
        tenant = entry.get("tenant") if isinstance(entry, dict) else None
        if not key or not isinstance(tenant, str) or not tenant:
            raise ConfigurationError(f'--api-keys entry {number} needs a non-empty key and {{"tenant": "<name>"}}')
        tenants[_digest(key)] = tenant
    return tenants


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read the keys file at ``path`` (a :class:`ConfigurationError` when it is missing or malformed)."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"--api-keys {path}: {type(exc).__name__}: {exc}") from None
    return ApiKeys(parse_api_keys(data), hashlib.sha256(raw).hexdigest())


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def salt_secret(env_secret: str | None, keys: ApiKeys | None) -> str | None:
    """The secret tenants' salts derive from: the configured one, else the keys file's digest, else None."""
    if env_secret:
        return env_secret
    return f"agentkv-gateway:{keys.file_digest}" if keys is not None else None
