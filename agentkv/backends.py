"""Backends and what their servers say: the declared model, window and endpoints, the parsed ``GET /models``
answer, and litellm's catalog window for cloud models.

Discovering and caching windows is :mod:`agentkv.discovery`.

Usage::

    fast = Backend("hosted_vllm/qwen3-8b", api_base="http://127.0.0.1:8001/v1")
    slow = Backend("hosted_vllm/qwen3-32b", api_base="http://127.0.0.1:8002/v1", window=131072)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

from agentkv._support.defaults import shared
from agentkv.http.transport import redact_url, unsendable_header
from agentkv.errors import ConfigurationError
from agentkv.providers.kinds import ALIASES, PROVIDERS, Provider, check_options, provider_of

__all__ = ["Backend", "ServerInfo", "WindowInfo", "catalog_window", "parse_models_response", "positive_window",
           "redact_secrets"]

# Keys whose values are credentials wherever they sit in kwargs or headers (``max_tokens`` is no ``_token``).
_SECRET_KEY = re.compile(r"(?i)^(api[_-]?key|x-api-key|authorization|proxy-authorization|password|passwd|"
                         r".*secret.*|.*_token|access[_-]?token|bearer|cookie)$")
REDACTED = "<redacted>"
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")  # an RFC 9110 token
# Headers a warm sets itself (the client's, or its body's): never repeated from a caller, whatever is configured.
_OWN_HEADERS = frozenset({"host", "content-length", "content-type", "content-encoding", "transfer-encoding",
                          "connection", "keep-alive", "te", "trailer", "upgrade", "expect", "accept-encoding"})
_MAX_FORWARD_HEADERS = 32


def redact_secrets(value: Any) -> Any:
    """A copy of ``value`` for reprs and messages: every credential-named key's value redacted (at any depth) and
    ``user:password@`` removed from URLs under ``api_base``/``base_url``; anything else is returned as it is."""
    if isinstance(value, Mapping):
        return {k: REDACTED if isinstance(k, str) and _SECRET_KEY.match(k) and v is not None
                else redact_url(v) if k in ("api_base", "base_url") and isinstance(v, str) else redact_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_secrets(item) for item in value)
    return value


@dataclass(frozen=True)
class Backend:
    """One model endpoint.

    ``model`` is a litellm model string (``"hosted_vllm/qwen3-8b"``); ``window`` declares the context
    window (otherwise it is discovered); ``tokenizer`` (a tiktoken encoding name, a transformers
    tokenizer, or a local tokenizer path) with ``chat_template`` makes token counts exact;
    ``completion_kwargs`` are extra litellm kwargs sent with every request to this backend; ``kv_events`` (and
    ``kv_events_replay``) name the server's vLLM KV-events endpoints for :class:`agentkv.cache_ledger.CacheLedger`.

    What kind of server it is follows from litellm's provider in ``model`` (:mod:`agentkv.providers`), never from
    whether ``api_base`` is set: ``anthropic/claude-sonnet-4-5`` behind a company proxy is Anthropic's API, and its
    requests carry Anthropic's cache marks, not vLLM's ``cache_salt``. ``provider=`` says it where the model string
    cannot (``"vllm"``, ``"openai"``, ``"anthropic"``, ``"gemini"`` or ``"managed"``, any other provider's API;
    ``"hosted"`` is taken for it too). ``cache_retention`` sets a managed cache's lifetime and ``explicit_cache``
    turns on Gemini's explicit caches (``docs/hosted.md``).

    A pool of replicas of one model is ``api_base=[url, url, …]`` (typed: ``replicas=(url, …)``): each conversation
    keeps one replica, moves to its next one while its own is down, and comes back (``docs/fleet.md``). Every request
    of a conversation carries its routing key (an opaque digest) under ``affinity_headers`` (``X-Session-ID``, what
    the vLLM router's ``consistent_hash`` reads; ``()`` sends none), and as ``user`` too with ``affinity_user``.
    A warm to this backend repeats only the caller's headers named in ``affinity_headers`` or ``forward_headers``
    (names, case-insensitive, at most 32: ``forward_headers=("X-Route-Hint",)``); no other header of a caller's,
    a credential under whatever name, rides on a warm.

        Backend("hosted_vllm/qwen3-32b", api_base="http://127.0.0.1:8002/v1", window=131072)
        Backend("hosted_vllm/qwen3-32b", api_base=["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"])
    """

    model: str
    api_base: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never in a repr, a traceback or assertion output
    name: str | None = None
    window: int | None = None
    tokenizer: Any = None
    chat_template: str | None = None
    completion_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # the server's KV-events PUB endpoint, for agentkv.cache_ledger (e.g. tcp://host:5557); a pool's: one per replica,
    # in the replicas' order
    kv_events: str | tuple[str, ...] | None = None
    kv_events_replay: str | tuple[str, ...] | None = None  # its replay endpoint (vLLM's replay_endpoint), to repair gaps
    affinity_headers: tuple[str, ...] = ("X-Session-ID",)  # where the conversation's routing key goes (() for none)
    affinity_user: bool = False  # also send the routing key as the body's ``user`` (when the caller set none)
    replicas: tuple[str, ...] = ()  # a pool's URLs (``api_base=[...]`` sets it); () for one server
    member_of: str | None = field(default=None, repr=False)  # the pool's label, on a replica made by ``replica()``
    provider: str | None = None  # the kind of server, when the model string cannot say (agentkv.providers)
    cache_retention: str | None = None  # a hosted cache's lifetime: Anthropic "5m"/"1h", OpenAI "in_memory"/"24h",
    #                                     Gemini explicit caches' TTL ("3600s"); None: the provider's default
    explicit_cache: bool = False  # Gemini: write an explicit cache at the warm, named by later requests
    forward_headers: tuple[str, ...] = ()  # the caller's headers (names) a warm repeats besides the affinity ones

    def __post_init__(self) -> None:
        self._pool_from_api_base()
        self._check_kv_events()
        names = self.affinity_headers
        if isinstance(names, str) or not all(isinstance(n, str) and _HEADER_NAME.match(n) for n in names):
            raise ConfigurationError(f"Backend.affinity_headers must be a tuple of HTTP header names, got {names!r}")
        object.__setattr__(self, "affinity_headers", tuple(names))
        object.__setattr__(self, "forward_headers", _forward_headers(self.forward_headers))
        _check_own_headers(self.completion_kwargs)
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigurationError(f"Backend.model must be a non-empty litellm model string, got {self.model!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ConfigurationError(f"Backend.window must be a positive int, got {self.window!r}")
        if self.api_base is not None and not str(self.api_base).startswith(("http://", "https://")):
            raise ConfigurationError(f"Backend.api_base must be an http(s) URL, got {redact_url(str(self.api_base))!r}")
        if self.provider is not None and self.provider not in PROVIDERS and self.provider not in ALIASES:
            raise ConfigurationError(f"Backend.provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        check_options(self.provider_kind, self.cache_retention, self.explicit_cache)

    def _check_kv_events(self) -> None:
        """ZMQ addresses; a pool's may be a list, one per replica (a tuple is kept)."""
        for name in ("kv_events", "kv_events_replay"):
            value: Any = getattr(self, name)
            listed = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
            if listed is not None:
                if len(listed) != len(self.replicas):
                    raise ConfigurationError(f"Backend.{name} as a list names one endpoint per replica: "
                                             f"{len(listed)} for {len(self.replicas)} replicas")
                object.__setattr__(self, name, listed)
            for endpoint in listed if listed is not None else (() if value is None else (value,)):
                if not str(endpoint).startswith(("tcp://", "ipc://", "inproc://")):
                    raise ConfigurationError(f"Backend KV-events endpoints must be ZMQ addresses, got {endpoint!r}")

    def _pool_from_api_base(self) -> None:
        """``api_base=[url, …]`` is a pool: ``replicas`` holds the URLs and ``api_base`` the first (what the
        Session's pool-unaware helpers, a count source among them, address)."""
        base: Any = self.api_base
        urls = tuple(base) if isinstance(base, Sequence) and not isinstance(base, str) else self.replicas
        if not urls:
            return
        if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ConfigurationError(f"Backend.api_base must be an http(s) URL or a list of them, got "
                                     f"{[redact_url(u) if isinstance(u, str) else u for u in urls]!r}")
        if len(set(u.rstrip("/") for u in urls)) != len(urls):
            raise ConfigurationError(f"Backend.api_base lists a replica twice: {[redact_url(u) for u in urls]!r}")
        object.__setattr__(self, "replicas", urls if len(urls) > 1 else ())
        object.__setattr__(self, "api_base", urls[0])

    def __repr__(self) -> str:
        """The fields but ``api_key``, with credentials stripped from ``api_base`` and ``completion_kwargs``."""
        shown = []
        for spec in fields(self):
            if spec.repr:
                value = getattr(self, spec.name)
                if spec.name == "api_base" and isinstance(value, str):
                    value = redact_url(value)
                elif spec.name == "replicas":
                    value = tuple(redact_url(u) for u in value)
                elif spec.name == "completion_kwargs":
                    value = redact_secrets(value)
                shown.append(f"{spec.name}={value!r}")
        return f"Backend({', '.join(shown)})"

    @property
    def label(self) -> str:
        """The name used in decisions, logs and stats."""
        return self.name or self.model

    @property
    def is_pool(self) -> bool:
        """Several replicas serve this model (``api_base=[url, …]``): each conversation keeps one of them."""
        return len(self.replicas) > 1

    def replica(self, url: str) -> "Backend":
        """This backend addressed to one of its replicas (the same label, model and settings; its own KV-events
        endpoints when the pool lists one per replica)."""
        if url not in self.replicas:
            raise ValueError(f"{redact_url(url)!r} is not a replica of {self.label!r}")
        at = self.replicas.index(url)
        events, replay = (value[at] if isinstance(value, tuple) else value
                          for value in (self.kv_events, self.kv_events_replay))
        return replace(self, api_base=url, replicas=(), name=self.label, member_of=self.label, kv_events=events,
                       kv_events_replay=replay)

    @property
    def replica_name(self) -> str:
        """What a cache ledger calls this server: the label, and a pool replica's URL after it."""
        return f"{self.label} {redact_url(self.api_base or '')}" if self.member_of else self.label

    @property
    def served_model(self) -> str:
        """The model id the server knows: the litellm string without its provider prefix."""
        return self.model.split("/", 1)[1] if "/" in self.model else self.model

    @property
    def server_root(self) -> str | None:
        """The server root (``api_base`` without ``/v1``), where vLLM serves ``/tokenize``."""
        if not self.api_base:
            return None
        base = self.api_base.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def provider_kind(self) -> Provider:
        """The kind of server this is (:func:`agentkv.providers.provider_of`): ``"vllm"`` for a self-hosted
        OpenAI-compatible server, else the hosted provider whose API the model string names."""
        return provider_of(self.model, self.api_base, self.provider)

    @property
    def self_hosted(self) -> bool:
        """A self-hosted OpenAI-compatible server (vLLM's wire: ``/models``, ``/tokenize``, ``cache_salt``)."""
        return self.provider_kind == "vllm"

    @property
    def is_cloud(self) -> bool:
        """A hosted provider's API (wherever its ``api_base`` points): it must be in litellm's catalog."""
        return not self.self_hosted

    def litellm_kwargs(self) -> dict[str, Any]:
        """The kwargs that address this backend in a litellm call."""
        kwargs: dict[str, Any] = {"model": self.model, **dict(self.completion_kwargs)}
        if self.api_base:
            kwargs["api_base"] = self.api_base
        if self.api_key:
            kwargs["api_key"] = self.api_key
        return kwargs


def _forward_headers(names: Any) -> tuple[str, ...]:
    """``Backend.forward_headers`` checked: a tuple (or list) of at most 32 distinct header names (RFC 9110 tokens,
    compared case-insensitively), none of the headers a warm sets itself."""
    listed = tuple(names) if isinstance(names, (tuple, list)) else None
    if listed is None or len(listed) > _MAX_FORWARD_HEADERS or not all(
            isinstance(n, str) and _HEADER_NAME.match(n) and n.lower() not in _OWN_HEADERS for n in listed):
        raise ConfigurationError(f"Backend.forward_headers must be a tuple of at most {_MAX_FORWARD_HEADERS} HTTP "
                                 f"header names (not {', '.join(sorted(_OWN_HEADERS))}), got {_shown(names)}")
    if len({n.lower() for n in listed}) != len(listed):
        raise ConfigurationError(f"Backend.forward_headers names a header twice: {listed!r}")
    return listed


def _shown(value: Any) -> str:
    """A configured value for an error message: escaped, and cut to 200 characters."""
    return ascii(value)[:200]


def _check_own_headers(kwargs: Mapping[str, Any]) -> None:
    """The headers in a Backend's ``completion_kwargs`` can be sent (none holds CR, LF, NUL or non-ASCII)."""
    for key in ("extra_headers", "headers"):
        bad = unsendable_header(kwargs.get(key) if isinstance(kwargs, Mapping) else None)
        if bad is not None:
            raise ConfigurationError(f"Backend.completion_kwargs[{key!r}]: header '{bad}' cannot be sent: a header "
                                     "name must be an HTTP token and its value printable ASCII")


@dataclass(frozen=True)
class ServerInfo:
    """What ``GET /models`` said: the window of the configured model and the ids being served."""

    window: int | None
    served_ids: frozenset[str]
    model_listed: bool


@dataclass(frozen=True)
class WindowInfo:
    """A backend's window and where it came from (declared, server, catalog, corrected or unknown), and
    whether the server (or, for a cloud model, litellm's catalog) knows the configured model."""

    window: int | None
    source: str
    model_known: bool | None = None


def positive_window(value: Any) -> int | None:
    """``value`` when it is an int >= 1 (a usable window), else None: 0, negatives, bools, text are unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def parse_models_response(payload: Any, served_model: str) -> ServerInfo:
    """Read ``max_model_len`` (or a proxy's ``max_input_tokens``) for ``served_model`` out of /models."""
    entries = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError("/models response has no 'data' list")
    ids = frozenset(str(e.get("id")) for e in entries if isinstance(e, Mapping) and e.get("id"))
    for entry in entries:
        if isinstance(entry, Mapping) and entry.get("id") == served_model:
            window = positive_window(entry.get("max_model_len")) or positive_window(entry.get("max_input_tokens"))
            return ServerInfo(window, ids, True)
    return ServerInfo(None, ids, False)


def catalog_window(model: str) -> int | None:
    """litellm's ``max_input_tokens`` for ``model`` (not ``max_tokens``, the output cap), or None.

    Imports litellm (seconds, the first time): the async path calls it on a worker thread. Found
    windows are remembered; misses are asked again, so a later ``litellm.register_model`` counts.
    """
    found: dict[str, int] = shared("catalog_windows", dict)
    if model in found:
        return found[model]
    from agentkv._support.env import import_litellm

    try:
        info = import_litellm().get_model_info(model)
    except Exception:  # litellm raises a bare Exception for unmapped models
        return None
    window = positive_window(info.get("max_input_tokens")) if isinstance(info, Mapping) else None
    if window:
        found[model] = window
    return window
