"""The kinds of backend agentkv knows, and which one a backend is: the providers' registration table.

A backend is either a self-hosted OpenAI-compatible server (``vllm``: vLLM's wire, ``/models`` windows, ``/tokenize``,
``cache_salt``) or a *managed* API, a provider serving its own models (Anthropic's, OpenAI's, Gemini's, or any other:
``managed``), whose prompt cache agentkv writes the provider's own way. Which one follows from litellm's provider in
the model string, never from whether an ``api_base`` is set ("hosted" is not used for it: litellm's ``hosted_vllm/``
is self-hosted):

    provider_of("hosted_vllm/qwen3-32b", "http://10.0.0.2:8000/v1")      # "vllm"
    provider_of("anthropic/claude-sonnet-4-5", "http://proxy.internal")  # "anthropic": a proxy is still Anthropic
    provider_of("openai/gpt-5.1", None)                                  # "openai"
    provider_of("openai/gpt-oss-20b", "http://127.0.0.1:8001/v1")        # "vllm": litellm's OpenAI-compatible route
    provider_of("openai/gpt-5.1", "https://llm-proxy.internal/v1", "openai")  # a proxy to OpenAI: declared

Adding a provider is its strategy module (:mod:`agentkv.providers`) and one row of :data:`KINDS`. Pure: no litellm
import, and nothing of the strategies is loaded here (a :class:`~agentkv.backends.Backend` reads this table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from agentkv.errors import ConfigurationError

__all__ = ["ALIASES", "KINDS", "MANAGED_PREFIXES", "PROVIDERS", "Kind", "Provider", "check_options", "kind_of",
           "litellm_provider", "provider_of"]

Provider = str
"""A kind's name: one of :data:`PROVIDERS`."""


@dataclass(frozen=True)
class Kind:
    """One kind of backend: its name, the litellm providers (model-string prefixes) that name it, the bare model ids
    litellm's catalog gives it, the hosts where a prefix names it (empty: anywhere; else only there, and a
    self-hosted server elsewhere), the ``cache_retention`` values it takes (a full-match pattern; None: none), whether
    it writes explicit caches, and its strategy (``"module:NAME"``, as an entry point names one)."""

    name: str
    strategy: str
    prefixes: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    retention: str | None = None
    retention_hint: str = ""
    explicit_cache: bool = False


KINDS: tuple[Kind, ...] = (
    Kind("vllm", "agentkv.providers.vllm:VLLM"),
    Kind("anthropic", "agentkv.providers.anthropic:ANTHROPIC", ("anthropic",), ("claude",), retention="5m|1h",
         retention_hint="one of ('5m', '1h')"),
    Kind("openai", "agentkv.providers.openai:OPENAI", ("openai",),
         ("gpt-", "o1", "o3", "o4", "chatgpt-", "codex-", "computer-use-"), ("api.openai.com",),
         retention="in_memory|24h", retention_hint="one of ('in_memory', '24h')"),
    Kind("gemini", "agentkv.providers.gemini:GEMINI", ("gemini",), ("gemini",),
         retention=r"[1-9][0-9]{0,6}(\.[0-9]{1,9})?s", retention_hint="a TTL in seconds such as '3600s'",
         explicit_cache=True),
    Kind("managed", "agentkv.providers.managed:MANAGED"),
)
"""The registered kinds (a kind's strategy module is loaded when a backend of it is first used)."""
PROVIDERS: tuple[str, ...] = tuple(kind.name for kind in KINDS)
"""``vllm``: a self-hosted OpenAI-compatible server; ``anthropic``/``openai``/``gemini``: those providers' APIs, their
prompt caches written their way; ``managed``: any other provider's API (no ``cache_salt``, no ``/models`` window)."""

# litellm providers whose model strings name a managed API wherever its api_base points (a proxy, a gateway, a fake)
MANAGED_PREFIXES = frozenset({
    "vertex_ai", "vertex_ai_beta", "bedrock", "bedrock_converse", "azure", "azure_ai", "mistral", "groq", "deepseek",
    "xai", "cohere", "cohere_chat", "together_ai", "fireworks_ai", "openrouter", "perplexity", "cerebras",
    "sambanova", "databricks", "watsonx",
}) | {prefix for kind in KINDS for prefix in kind.prefixes if not kind.hosts}
_BY_NAME = {kind.name: kind for kind in KINDS}
ALIASES = {"hosted": "managed"}
"""Names a kind is also declared by: ``provider="hosted"``, the managed kind's first name."""


def kind_of(name: str) -> Kind:
    """The registered :class:`Kind` called ``name`` (:class:`KeyError` for none)."""
    return _BY_NAME[name]


def litellm_provider(model: str) -> str:
    """The provider prefix of a litellm model string (``""`` for a bare model name)."""
    return model.split("/", 1)[0].lower() if "/" in model else ""


def provider_of(model: str, api_base: str | None, declared: str | None = None) -> Provider:
    """The kind of server ``model`` is served by: ``declared`` (``Backend(provider=...)``) when given, else the kind
    whose prefixes name litellm's provider (at its hosts, where it lists some: ``openai/`` is OpenAI's API at
    ``api.openai.com`` and an OpenAI-compatible self-hosted server elsewhere, litellm's documented way to reach one);
    ``managed`` for the other managed APIs in :data:`MANAGED_PREFIXES`; ``hosted_vllm/`` and every other provider
    with an ``api_base`` are self-hosted; a model with no ``api_base`` is a managed API."""
    if declared is not None:
        return ALIASES.get(declared, declared)
    prefix = litellm_provider(model)
    for kind in KINDS:
        if prefix and prefix in kind.prefixes:
            host = (urlsplit(api_base).hostname or "") if api_base else (kind.hosts or ("",))[0]
            return kind.name if not kind.hosts or host in kind.hosts else "vllm"
    if prefix:
        return "managed" if prefix in MANAGED_PREFIXES or not api_base else "vllm"
    bare = model.lower()  # litellm infers the provider of a bare model name from its catalog
    named = next((kind.name for kind in KINDS if kind.models and bare.startswith(kind.models)), None)
    return named or ("vllm" if api_base else "managed")


def check_options(provider: str, retention: str | None, explicit_cache: bool) -> None:
    """:class:`ConfigurationError` unless ``provider`` is a registered kind that takes ``retention`` (None always
    does) and, when ``explicit_cache``, writes explicit caches."""
    kind = _BY_NAME.get(provider)
    if kind is None:
        raise ConfigurationError(f"Backend.provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    if retention is not None and (kind.retention is None or not isinstance(retention, str)
                                  or not re.fullmatch(kind.retention, retention)):
        raise ConfigurationError(f"Backend.cache_retention for a {provider} backend must be "
                                 f"{kind.retention_hint or '(none: it has no cache retention setting)'}, "
                                 f"got {retention!r}")
    if not isinstance(explicit_cache, bool) or (explicit_cache and not kind.explicit_cache):
        raise ConfigurationError(f"Backend.explicit_cache is a bool for a backend with explicit caches (Gemini), got "
                                 f"{explicit_cache!r} for a {provider} backend")
