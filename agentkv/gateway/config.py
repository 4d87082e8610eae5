"""The gateway's configuration: one frozen value object, built from the command line and the environment.

    GatewayConfig(fast_url="http://127.0.0.1:8001/v1", fast_model="qwen3-8b",
                  slow_url="http://127.0.0.1:8002/v1", slow_model="qwen3-32b", api_keys="keys.json")

The command line sets the contract's flags; the operating limits come from the environment, read here
and only here, when the gateway starts:

- ``AGENTKV_GATEWAY_MAX_BODY_BYTES``: the largest request body accepted (413 beyond it); default 16 MiB.
- ``AGENTKV_GATEWAY_CONNECT_TIMEOUT_S``: connecting to a backend; default 5 s (then the request fails over).
- ``AGENTKV_GATEWAY_READ_TIMEOUT_S``: the longest wait for a backend's next bytes (a whole answer, or the next
  chunk of a stream); default 600 s.
- ``AGENTKV_GATEWAY_MAX_SESSIONS``: conversations held at once (the least recently used goes first); 10,000.
- ``AGENTKV_GATEWAY_SESSION_IDLE_S``: a conversation idle this long is dropped; default 3,600 s.
- ``AGENTKV_CACHE_SALT_SECRET`` (the library's): the secret per-tenant ``cache_salt`` values derive from.

Worker processes (``--workers N``) receive the whole configuration as JSON in ``AGENTKV_GATEWAY_CONFIG``
(:meth:`GatewayConfig.to_env` / :meth:`GatewayConfig.from_env`), set by the command line before they start.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from agentkv.http.transport import redact_url
from agentkv.errors import ConfigurationError

__all__ = ["CONFIG_ENV", "GatewayConfig", "shown_urls", "urls_of"]

CONFIG_ENV = "AGENTKV_GATEWAY_CONFIG"
_LIMITS_ENV = {
    "max_body_bytes": ("AGENTKV_GATEWAY_MAX_BODY_BYTES", int),
    "connect_timeout_s": ("AGENTKV_GATEWAY_CONNECT_TIMEOUT_S", float),
    "read_timeout_s": ("AGENTKV_GATEWAY_READ_TIMEOUT_S", float),
    "max_sessions": ("AGENTKV_GATEWAY_MAX_SESSIONS", int),
    "session_idle_s": ("AGENTKV_GATEWAY_SESSION_IDLE_S", float),
}


@dataclass(frozen=True)
class GatewayConfig:
    """What one gateway serves and how: the two backends, the listener, keys, shared state and limits.

    ``fast_url``/``slow_url`` are OpenAI-compatible base URLs ending in ``/v1`` (a comma-separated list is a pool of
    replicas of one model: each conversation keeps one, see ``docs/fleet.md``); ``*_model`` the model ids they serve.
    ``api_keys`` is the path of a JSON ``{"<key>": {"tenant": "<tenant>"}}`` file (None: one
    anonymous tenant); ``redis_url`` shares warm-ahead guards and windows across processes.
    """

    fast_url: str
    fast_model: str
    slow_url: str
    slow_model: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: str | None = None
    redis_url: str | None = None
    workers: int = 1
    max_body_bytes: int = 16 << 20
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    max_sessions: int = 10_000
    session_idle_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("fast_url", "slow_url"):
            url = getattr(self, name)
            if not isinstance(url, str) or not all(u.strip().startswith(("http://", "https://")) for u in url.split(",")):
                raise ConfigurationError(f"--{name[:4]} must be an http(s) base URL ending in /v1 (or a comma-separated "
                                         f"list of them, a pool), got {shown_urls(url)!r}")
        for name in ("fast_model", "slow_model"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigurationError(f"--{name.replace('_', '-')} must name the model the backend serves")
        for name in ("workers", "max_body_bytes", "max_sessions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"GatewayConfig.{name} must be a positive int, got {value!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "session_idle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"GatewayConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigurationError(f"--port must be a TCP port, got {self.port!r}")

    def with_env_limits(self, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """This configuration with the limits the environment sets (see the module's list)."""
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for name, (variable, kind) in _LIMITS_ENV.items():
            raw = (env.get(variable) or "").strip()
            if raw:
                try:
                    changes[name] = kind(raw)
                except ValueError:
                    raise ConfigurationError(f"{variable} must be a number, got {raw!r}") from None
        return replace(self, **changes)

    def to_env(self) -> str:
        """The JSON that :meth:`from_env` reads back (what worker processes are handed)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """The configuration the command line left in ``AGENTKV_GATEWAY_CONFIG``."""
        raw = (os.environ if environ is None else environ).get(CONFIG_ENV)
        if not raw:
            raise ConfigurationError(f"{CONFIG_ENV} is not set: start the gateway with `agentkv gateway`")
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def shown_urls(value: object) -> object:
    """A configured URL (or comma-separated list) as messages show it: no credentials, query string or fragment."""
    return ",".join(redact_url(u.strip()) for u in value.split(",")) if isinstance(value, str) else value


def urls_of(value: str) -> tuple[str, ...]:
    """``--fast``/``--slow``'s value as URLs: one, or a pool's (comma-separated)."""
    return tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())
