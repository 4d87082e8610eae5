"""What every managed API shares (a provider serving its own models, as opposed to a self-hosted vLLM), and the
strategy of the managed APIs agentkv writes nothing special for (Bedrock, Azure, Vertex AI, Mistral, ...).

A managed API never receives a ``cache_salt`` (no provider takes one: Anthropic answers
``400 extra_body: Extra inputs are not permitted``), nor an ``extra_body`` that held only one; its warms go through
litellm; its prices and shortest cacheable prompt are litellm's, read only once litellm is loaded (a managed model's
requests load it): never an import on a request's path.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

from agentkv._support.defaults import shared
from agentkv.backends import Backend
from agentkv.providers import Marks, SessionContext, SessionPart
from agentkv.providers.prices import Prices, prices_for
from agentkv.tenancy import with_cache_salt
from agentkv.wire.usage import Usage

__all__ = ["DEFAULT_CACHE_MINIMUM", "MANAGED", "ManagedApi", "unsalted"]

DEFAULT_CACHE_MINIMUM = 1024
"""litellm's provider-agnostic shortest cacheable prompt (OpenAI's, and most Anthropic models')."""


def unsalted(call: Mapping[str, Any]) -> dict[str, Any]:
    """litellm kwargs with no ``cache_salt`` anywhere, and no ``extra_body`` when the salt was all it held."""
    out = with_cache_salt(call, None)
    if out.get("extra_body") == {}:
        del out["extra_body"]
    return out


class ManagedApi:
    """A managed API's strategy: its requests unsalted and otherwise as the caller wrote them. The named providers'
    strategies extend it with their marks."""

    name = "managed"

    def marked(self, backend: Backend, call: Mapping[str, Any], marks: Marks) -> dict[str, Any]:
        return unsalted(call)

    def warm_url(self, backend: Backend, *, text: bool = False) -> str | None:
        return None  # through litellm, which speaks the provider's API

    def prices(self, backend: Backend) -> Prices | None:
        return prices_for(backend.model)

    def cache_minimum(self, backend: Backend) -> int | None:
        """litellm's ``get_prompt_cache_min_tokens`` for ``backend.model`` (its default until litellm is loaded)."""
        if "litellm" not in sys.modules:
            return DEFAULT_CACHE_MINIMUM
        found: dict[str, int] = shared("cache_minimums", dict)
        if backend.model not in found:
            from litellm.utils import get_prompt_cache_min_tokens

            found[backend.model] = int(get_prompt_cache_min_tokens(backend.model))
        return found[backend.model]

    def cache_moves(self, backend: Backend, usage: Usage) -> bool:
        return True  # each request's marks wrote the cache up to its end

    def session_part(self, backends: Sequence[Backend], context: SessionContext) -> SessionPart | None:
        return None


MANAGED = ManagedApi()
