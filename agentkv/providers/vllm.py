"""A self-hosted OpenAI-compatible server (vLLM's wire): its requests carry the tenant's ``cache_salt`` (the salt wins
over any the caller set: :func:`agentkv.tenancy.with_cache_salt`), its warms go out as raw POSTs where it can take
them, counts come from its ``/tokenize``, and it costs nothing per token.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from agentkv.backends import Backend
from agentkv.providers import Marks, SessionContext, SessionPart
from agentkv.providers.prices import Prices
from agentkv.tenancy import with_cache_salt
from agentkv.wire.usage import Usage

__all__ = ["VLLM", "SelfHosted"]

# The litellm providers whose self-hosted servers take the OpenAI body as it is: their warms go out as raw POSTs.
_RAW_PROVIDERS = ("hosted_vllm", "openai")


class SelfHosted:
    """The strategy of a self-hosted OpenAI-compatible server."""

    name = "vllm"

    def marked(self, backend: Backend, call: Mapping[str, Any], marks: Marks) -> dict[str, Any]:
        return with_cache_salt(call, marks.salt, keep_caller=marks.keep_caller_salt)

    def warm_url(self, backend: Backend, *, text: bool = False) -> str | None:
        """Its ``/chat/completions`` (``/completions``) when it takes the OpenAI body as it is and needs no key: the
        warm then never waits for a litellm import and carries exactly the bytes the caller's request will carry."""
        provider = backend.model.split("/", 1)[0] if "/" in backend.model else ""
        if not backend.api_base or backend.api_key or provider not in _RAW_PROVIDERS:
            return None
        return f"{backend.api_base.rstrip('/')}/{'completions' if text else 'chat/completions'}"

    def prices(self, backend: Backend) -> Prices | None:
        return None  # its cost is the server's, not per token

    def cache_minimum(self, backend: Backend) -> int | None:
        return None  # vLLM caches every full block

    def cache_moves(self, backend: Backend, usage: Usage) -> bool:
        return True

    def session_part(self, backends: Sequence[Backend], context: SessionContext) -> SessionPart | None:
        return None


VLLM = SelfHosted()
