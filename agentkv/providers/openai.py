"""OpenAI's API: its prompt cache is automatic; a conversation's requests carry its routing key as
``prompt_cache_key`` (a caller's own wins), so that OpenAI routes them to the same cache, and the backend's
``cache_retention`` (``"in_memory"`` or ``"24h"``) as ``prompt_cache_retention``
(:func:`agentkv.wire.hosted.openai_keyed`).
"""

from __future__ import annotations

from typing import Any, Mapping

from agentkv.backends import Backend
from agentkv.providers import Marks
from agentkv.providers.managed import ManagedApi, unsalted
from agentkv.wire.hosted import openai_keyed

__all__ = ["OPENAI", "OpenAiApi"]


class OpenAiApi(ManagedApi):
    """OpenAI's strategy: the conversation's cache key and retention on every request."""

    name = "openai"

    def marked(self, backend: Backend, call: Mapping[str, Any], marks: Marks) -> dict[str, Any]:
        return openai_keyed(unsalted(call), routing_key=marks.routing_key, retention=backend.cache_retention)


OPENAI = OpenAiApi()
