"""Anthropic's API: its prompt cache is written by ``cache_control`` breakpoints (at most 4 in a request), placed on
the conversation's last cache write and on the request's end (:func:`agentkv.wire.hosted.anthropic_marked`), with
the backend's ``cache_retention`` (``"5m"`` or ``"1h"``) as their TTL; a 1-hour write is priced as one.
"""

from __future__ import annotations

from typing import Any, Mapping

from agentkv.backends import Backend
from agentkv.providers import Marks
from agentkv.providers.managed import ManagedApi, unsalted
from agentkv.providers.prices import Prices, prices_for
from agentkv.wire.hosted import anthropic_marked

__all__ = ["ANTHROPIC", "AnthropicApi"]


class AnthropicApi(ManagedApi):
    """Anthropic's strategy: breakpoints on every request, the 1-hour write price under ``cache_retention="1h"``."""

    name = "anthropic"

    def marked(self, backend: Backend, call: Mapping[str, Any], marks: Marks) -> dict[str, Any]:
        return anthropic_marked(unsalted(call), cache_end=marks.cache_end, ttl=backend.cache_retention)

    def prices(self, backend: Backend) -> Prices | None:
        return prices_for(backend.model, ttl_1h=backend.cache_retention == "1h")


ANTHROPIC = AnthropicApi()
