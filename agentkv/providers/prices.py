"""What a request to a managed API cost and what its cache read saved, priced from litellm's cost map.

    prices = prices_for("anthropic/claude-sonnet-4-5")      # litellm's per-token prices (imports litellm)
    usage = cache_usage(response_usage(response))           # the provider's cache write and read tokens
    request_cost(usage, prices), read_saving(usage, prices)  # dollars spent, dollars the cache read saved

Every provider's cache fields are read as litellm surfaces them: Anthropic's ``cache_creation_input_tokens`` and
``cache_read_input_tokens``, OpenAI's ``prompt_tokens_details.cached_tokens`` and ``cache_write_tokens``, Gemini's
``cachedContentTokenCount`` (litellm: ``cached_tokens``). Pure but for :func:`prices_for`, which reads litellm's map
(on a warm's or an answer's background path, never on a request's). Each provider's strategy says which prices apply
to a backend (:meth:`agentkv.providers.ProviderStrategy.prices`: Anthropic's 1-hour writes, Gemini's storage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from agentkv._support.defaults import shared
from agentkv.wire.usage import Usage, token_figure

__all__ = ["CacheUsage", "Prices", "cache_usage", "prices_for", "read_saving", "request_cost"]


@dataclass(frozen=True)
class Prices:
    """USD per token: uncached input, output, a cache write (Anthropic 1.25× input for 5 min, 2× for 1 h; OpenAI
    GPT-5.6 1.25×; input where the provider bills none), a cache read, and a stored token-hour (Gemini's explicit
    caches; 0 elsewhere)."""

    input: float
    output: float
    cache_write: float
    cache_read: float
    storage_per_hour: float = 0.0


@dataclass(frozen=True)
class CacheUsage:
    """An answer's token counts: ``prompt_tokens`` in all (cached included), of them ``cache_write`` written to and
    ``cache_read`` read from the provider's cache, and ``completion_tokens``."""

    prompt_tokens: int = 0
    cache_write: int = 0
    cache_read: int = 0
    completion_tokens: int = 0

    @property
    def uncached(self) -> int:
        """Prompt tokens billed at the plain input price."""
        return max(0, self.prompt_tokens - self.cache_write - self.cache_read)


def cache_usage(usage: Usage) -> CacheUsage:
    """The :class:`CacheUsage` of an answer's :class:`~agentkv.wire.usage.Usage` (litellm reports every provider's
    prompt tokens with the cached ones included, as OpenAI does). A figure absent or refused when it was read
    (:func:`~agentkv.wire.usage.token_figure`) counts 0, so no cost or saving is ever negative or priced from an
    absurd count."""
    return CacheUsage(_tokens(usage.prompt_tokens), _tokens(usage.cache_write_tokens), _tokens(usage.cached_tokens),
                      _tokens(usage.completion_tokens))


def _tokens(value: int | None) -> int:
    """A count to price: a believable one as it is, anything else 0 (a Usage built by hand is checked too)."""
    return token_figure(value)[0] or 0


def request_cost(usage: CacheUsage, prices: Prices) -> float:
    """Dollars this answer cost: uncached input, cache writes and reads, and output, each at its price."""
    return (usage.uncached * prices.input + usage.cache_write * prices.cache_write
            + usage.cache_read * prices.cache_read + usage.completion_tokens * prices.output)


def read_saving(usage: CacheUsage, prices: Prices) -> float:
    """Dollars the cache read saved against sending the same tokens uncached."""
    return usage.cache_read * max(0.0, prices.input - prices.cache_read)


def prices_for(model: str, *, ttl_1h: bool = False, storage_per_hour: float = 0.0) -> Prices | None:
    """litellm's prices for ``model`` (None when its map does not know it; ``ttl_1h``: its 1-hour cache write price),
    with ``storage_per_hour`` (USD per stored token-hour, which litellm's map does not hold), remembered per
    process."""
    key = ("prices", model, ttl_1h, storage_per_hour)
    found: dict[Any, Prices | None] = shared("litellm_prices", dict)
    if key not in found:
        found[key] = _looked_up(model, ttl_1h, storage_per_hour)
    return found[key]


def _looked_up(model: str, ttl_1h: bool, storage: float) -> Prices | None:
    from agentkv._support.env import import_litellm

    try:
        info: Mapping[str, Any] = import_litellm().get_model_info(model)
    except Exception:  # litellm raises a bare Exception for a model its map does not have
        return None
    base = _price(info.get("input_cost_per_token"))
    if base is None:
        return None
    write = _price(info.get("cache_creation_input_token_cost_above_1hr" if ttl_1h else "cache_creation_input_token_cost"))
    read = _price(info.get("cache_read_input_token_cost"))
    return Prices(base, _price(info.get("output_cost_per_token")) or 0.0, base if write is None else write,
                  base if read is None else read, storage)


def _price(value: Any) -> float | None:
    """A per-token price from the map: a finite number >= 0 (a model registered with text in it has none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        return None
    return float(value)
