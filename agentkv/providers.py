"""What kind of server a backend is, from litellm's provider in its model string (never from whether an ``api_base``
is set): a self-hosted OpenAI-compatible server (vLLM's wire: ``/models`` windows, ``/tokenize``, ``cache_salt``) or
a hosted provider's API, whose prompt cache agentkv writes the provider's own way (:mod:`agentkv.wire.hosted`).

    provider_of("hosted_vllm/qwen3-32b", "http://10.0.0.2:8000/v1")      # "vllm"
    provider_of("anthropic/claude-sonnet-4-5", "http://proxy.internal")  # "anthropic": a proxy is still Anthropic
    provider_of("openai/gpt-5.1", None)                                  # "openai"
    provider_of("openai/gpt-oss-20b", "http://127.0.0.1:8001/v1")        # "vllm": litellm's OpenAI-compatible route
    provider_of("openai/gpt-5.1", "https://llm-proxy.internal/v1", "openai")  # a proxy to OpenAI: declared

Pure: no litellm import.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from agentkv.errors import ConfigurationError

__all__ = ["HOSTED_PROVIDERS", "PROVIDERS", "RETENTIONS", "Provider", "check_retention", "litellm_provider",
           "provider_of"]

Provider = Literal["vllm", "anthropic", "openai", "gemini", "hosted"]
PROVIDERS: tuple[str, ...] = ("vllm", "anthropic", "openai", "gemini", "hosted")
"""``vllm``: a self-hosted OpenAI-compatible server; ``anthropic``/``openai``/``gemini``: those providers' APIs, their
prompt caches written their way; ``hosted``: any other provider's API (no ``cache_salt``, no ``/models`` window)."""

# litellm providers whose model strings name a hosted API wherever its api_base points (a proxy, a gateway, a fake)
HOSTED_PROVIDERS = frozenset({
    "anthropic", "gemini", "vertex_ai", "vertex_ai_beta", "bedrock", "bedrock_converse", "azure", "azure_ai",
    "mistral", "groq", "deepseek", "xai", "cohere", "cohere_chat", "together_ai", "fireworks_ai", "openrouter",
    "perplexity", "cerebras", "sambanova", "databricks", "watsonx",
})
_NAMED = {"anthropic": "anthropic", "gemini": "gemini", "openai": "openai"}
# model ids OpenAI serves: a bare ``<one of these>`` is OpenAI's API (litellm infers the provider from its catalog)
_OPENAI_MODELS = ("gpt-", "o1", "o3", "o4", "chatgpt-", "codex-", "computer-use-")
_OPENAI_HOSTS = ("api.openai.com",)


def litellm_provider(model: str) -> str:
    """The provider prefix of a litellm model string (``""`` for a bare model name)."""
    return model.split("/", 1)[0].lower() if "/" in model else ""


def provider_of(model: str, api_base: str | None, declared: str | None = None) -> Provider:
    """The kind of server ``model`` is served by: ``declared`` (``Backend(provider=...)``) when given, else litellm's
    provider: a hosted API for the providers in :data:`HOSTED_PROVIDERS`; ``openai/`` is OpenAI's API for OpenAI's
    own model ids or host, and an OpenAI-compatible self-hosted server otherwise (litellm's documented way to reach
    one); ``hosted_vllm/`` and every other provider with an ``api_base`` are self-hosted; a model with no
    ``api_base`` is a hosted API."""
    if declared is not None:
        return declared  # type: ignore[return-value]  # checked against PROVIDERS by Backend
    prefix = litellm_provider(model)
    if prefix == "openai":  # litellm's route to OpenAI, and to any OpenAI-compatible server behind an api_base
        host = (urlsplit(api_base).hostname or "") if api_base else "api.openai.com"
        return "openai" if host in _OPENAI_HOSTS else "vllm"
    if prefix in HOSTED_PROVIDERS:
        return _NAMED.get(prefix, "hosted")  # type: ignore[return-value]
    if prefix:
        return "vllm" if api_base else "hosted"
    bare = model.lower()  # litellm infers the provider of a bare model name from its catalog
    return ("openai" if bare.startswith(_OPENAI_MODELS) else "anthropic" if bare.startswith("claude")
            else "gemini" if bare.startswith("gemini") else "vllm" if api_base else "hosted")


RETENTIONS = {"anthropic": ("5m", "1h"), "openai": ("in_memory", "24h")}
"""``Backend(cache_retention=...)`` values each provider takes (Gemini: a duration such as ``"3600s"``)."""
_GEMINI_TTL = re.compile(r"^[1-9][0-9]{0,6}(\.[0-9]{1,9})?s$")


def check_retention(provider: str, retention: str | None) -> None:
    """:class:`ConfigurationError` unless ``retention`` is one ``provider`` takes (None always is)."""
    if retention is None:
        return
    if provider == "gemini":
        if not isinstance(retention, str) or not _GEMINI_TTL.match(retention):
            raise ConfigurationError(f"Backend.cache_retention for Gemini is a TTL in seconds such as '3600s', "
                                     f"got {retention!r}")
        return
    allowed = RETENTIONS.get(provider)
    if allowed is None or retention not in allowed:
        raise ConfigurationError(f"Backend.cache_retention for a {provider} backend must be one of "
                                 f"{allowed or '(none: it has no cache retention setting)'}, got {retention!r}")
