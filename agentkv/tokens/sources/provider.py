"""Exact counts from a hosted provider's own count endpoint, of the body litellm sends it.

- Anthropic: ``POST /v1/messages/count_tokens`` (tools and system included) answers ``{"input_tokens": N}``;
- Gemini: ``POST /v1beta/models/{model}:countTokens`` with a ``generateContentRequest`` answers ``{"totalTokens": N}``.

The body is built by litellm's own provider transformation (what ``litellm.completion`` would send), so the count is
of the tokens the provider will bill. Like vLLM's ``/tokenize`` (:class:`~agentkv.tokens.ServerSource`, whose
cache, breaker and span these share) it is asked only where a decision depends on the difference, and only once
litellm is loaded (a hosted model's first request loads it): never an import on a request's path.

    source = AnthropicCountSource(Backend("anthropic/claude-sonnet-4-5", api_key="..."))
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

from agentkv._support.effects import Machine
from agentkv.backends import Backend
from agentkv.tokens.payload import CountUnavailable, Payload
from agentkv.tokens.sources.server import ServerSource

__all__ = ["ANTHROPIC_VERSION", "AnthropicCountSource", "GeminiCountSource", "provider_source"]

ANTHROPIC_VERSION = "2023-06-01"
_PROBE = ({"role": "user", "content": "."},)  # a provider refuses an empty text block


def _litellm() -> Any:
    if "litellm" not in sys.modules:
        raise CountUnavailable("litellm is not loaded yet (a hosted model's first request loads it)")
    return sys.modules["litellm"]


def _root(api_base: str | None, default: str, suffixes: tuple[str, ...]) -> str:
    base = (api_base or default).rstrip("/")
    for suffix in suffixes:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


class _ProviderSource(ServerSource):
    """What the provider sources share: no token ids (a provider returns counts only), tool probes on a one-token
    message (a provider refuses an empty one)."""

    def request_body(self, payload: Payload, **overrides: Any) -> dict[str, Any]:
        """The count body for ``payload``: what litellm's provider transformation sends (``_sent``)."""
        if payload.messages is None:
            raise CountUnavailable(f"{self.name} counts chat messages only")
        try:
            return self._sent(payload)
        except CountUnavailable:
            raise
        except Exception as exc:  # litellm could not transform it: the estimate answers, the request goes on
            raise CountUnavailable(f"litellm's transformation for {self.name} failed: {type(exc).__name__}") from exc

    def _sent(self, payload: Payload) -> dict[str, Any]:
        raise NotImplementedError

    def token_ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> list[int]:
        raise CountUnavailable(f"{self.name} count endpoints return no token ids")

    def ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> Machine[list[int]]:
        yield from ()  # a machine, as its base's
        raise CountUnavailable(f"{self.name} count endpoints return no token ids")

    def _tool_probes(self, payload: Payload) -> list[dict[str, Any]]:
        if not payload.tools or payload.messages is None:
            return []
        return [self.request_body(Payload(_PROBE, payload.tools)), self.request_body(Payload(_PROBE))]

    def _openai_params(self, payload: Payload) -> dict[str, Any]:
        params: dict[str, Any] = {"max_tokens": 1}
        if payload.tools:
            params["tools"] = [dict(tool) for tool in payload.tools]
        if payload.tools and payload.tool_choice is not None:
            params["tool_choice"] = payload.tool_choice
        return params

    def _key(self, *env: str) -> str | None:
        """The key litellm would send: the backend's, its ``completion_kwargs``', else the provider's variables."""
        key = self._backend.api_key or self._backend.completion_kwargs.get("api_key")
        return key if isinstance(key, str) and key else next((os.environ[e] for e in env if os.environ.get(e)), None)


class AnthropicCountSource(_ProviderSource):
    """Exact counts from Anthropic's ``/v1/messages/count_tokens``."""

    name = "anthropic_count"

    def endpoint(self, backend: Backend) -> str:
        return _root(backend.api_base, "https://api.anthropic.com", ("/v1/messages", "/v1")) + \
            "/v1/messages/count_tokens"

    def headers(self) -> dict[str, str]:
        key = self._key("ANTHROPIC_API_KEY")
        return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": key} if key else {})}

    def _sent(self, payload: Payload) -> dict[str, Any]:
        """What litellm's Anthropic transformation sends for ``payload``, less the budget."""
        _litellm()
        from litellm.llms.anthropic.chat.transformation import AnthropicConfig

        config, model = AnthropicConfig(), self._backend.served_model
        params = config.map_openai_params(non_default_params=self._openai_params(payload), optional_params={},
                                          model=model, drop_params=False)
        sent = config.transform_request(model=model, messages=[dict(m) for m in payload.messages or ()],
                                        optional_params=params, litellm_params={}, headers={})
        return {k: sent[k] for k in ("model", "messages", "system", "tools", "tool_choice", "thinking") if k in sent}

    def _checked(self, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, Mapping) or not isinstance(answer.get("input_tokens"), int):
            raise CountUnavailable("count_tokens answered without an integer 'input_tokens'")
        return {"count": answer["input_tokens"]}


class GeminiCountSource(_ProviderSource):
    """Exact counts from Gemini's ``models/{model}:countTokens``."""

    name = "gemini_count"

    def endpoint(self, backend: Backend) -> str:
        root = _root(backend.api_base, "https://generativelanguage.googleapis.com", ("/v1beta",))
        return f"{root}/v1beta/models/{backend.served_model}:countTokens"

    def headers(self) -> dict[str, str]:
        key = self._key("GEMINI_API_KEY", "GOOGLE_API_KEY")
        return {"x-goog-api-key": key} if key else {}

    def _sent(self, payload: Payload) -> dict[str, Any]:
        """What litellm's Gemini transformation sends for ``payload``, as a countTokens body."""
        _litellm()
        from litellm.llms.vertex_ai.gemini.transformation import _transform_request_body
        from litellm.llms.vertex_ai.gemini.vertex_and_google_ai_studio_gemini import VertexGeminiConfig

        model = self._backend.served_model
        params = VertexGeminiConfig().map_openai_params(non_default_params=self._openai_params(payload),
                                                        optional_params={}, model=model, drop_params=False)
        sent = _transform_request_body(messages=[dict(m) for m in payload.messages or ()], model=model,
                                       optional_params=params, custom_llm_provider="gemini", litellm_params={},
                                       cached_content=None)
        request = {k: sent[k] for k in ("contents", "system_instruction", "systemInstruction", "tools", "toolConfig")
                   if k in sent}
        return {"generateContentRequest": {"model": f"models/{model}", **request}}

    def _checked(self, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, Mapping) or not isinstance(answer.get("totalTokens"), int):
            raise CountUnavailable("countTokens answered without an integer 'totalTokens'")
        return {"count": answer["totalTokens"]}


def provider_source(backend: Backend, **kwargs: Any) -> ServerSource | None:
    """The count-endpoint source for a hosted ``backend`` whose provider has one, else None."""
    kind = backend.provider_kind
    if kind == "anthropic":
        return AnthropicCountSource(backend, **kwargs)
    if kind == "gemini":
        return GeminiCountSource(backend, **kwargs)
    return None
