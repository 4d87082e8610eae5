"""What a request to a hosted model cost and what its cache read saved, priced from litellm's cost map.

    prices = prices_for("anthropic/claude-sonnet-4-5")      # litellm's per-token prices (imports litellm)
    usage = cache_usage(response_usage(response))           # the provider's cache write and read tokens
    request_cost(usage, prices), read_saving(usage, prices)  # dollars spent, dollars the cache read saved

Every provider's cache fields are read as litellm surfaces them: Anthropic's ``cache_creation_input_tokens`` and
``cache_read_input_tokens``, OpenAI's ``prompt_tokens_details.cached_tokens`` and ``cache_write_tokens``, Gemini's
``cachedContentTokenCount`` (litellm: ``cached_tokens``). Pure but for :func:`prices_for`, which reads litellm's map
(on a warm's or an answer's background path, never on a request's).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from agentkv._defaults import shared
from agentkv.events import emit
from agentkv.wire.usage import Usage, token_figure

if TYPE_CHECKING:
    from agentkv.backends import Backend
    from agentkv.stats import SessionStats

__all__ = ["CacheUsage", "Prices", "account", "cache_usage", "loaded_prices", "prices_for", "read_saving",
           "request_cost"]


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


# Gemini bills explicit caches' storage per token-hour, a price litellm's map does not hold: Google's published
# prices (ai.google.dev/gemini-api/docs/pricing, USD per 1M tokens per hour) for the models that have one.
_STORAGE_PER_MTOK_HOUR = {"gemini-2.5-pro": 4.50, "gemini-2.5-flash": 1.00, "gemini-2.5-flash-lite": 1.00,
                          "gemini-3-pro-preview": 4.50}


def prices_for(model: str, *, ttl_1h: bool = False) -> Prices | None:
    """litellm's prices for ``model`` (None when its map does not know it), remembered per process."""
    key = ("prices", model, ttl_1h)
    found: dict[Any, Prices | None] = shared("litellm_prices", dict)
    if key not in found:
        found[key] = _looked_up(model, ttl_1h)
    return found[key]


def _looked_up(model: str, ttl_1h: bool) -> Prices | None:
    from agentkv._env import import_litellm

    try:
        info: Mapping[str, Any] = import_litellm().get_model_info(model)
    except Exception:  # litellm raises a bare Exception for a model its map does not have
        return None
    base = _price(info.get("input_cost_per_token"))
    if base is None:
        return None
    write = _price(info.get("cache_creation_input_token_cost_above_1hr" if ttl_1h else "cache_creation_input_token_cost"))
    read = _price(info.get("cache_read_input_token_cost"))
    served = model.split("/", 1)[-1]
    storage = _STORAGE_PER_MTOK_HOUR.get(served, 0.0) / 1e6 if model.startswith("gemini/") else 0.0
    return Prices(base, _price(info.get("output_cost_per_token")) or 0.0, base if write is None else write,
                  base if read is None else read, storage)


def _price(value: Any) -> float | None:
    """A per-token price from the map: a finite number >= 0 (a model registered with text in it has none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        return None
    return float(value)


def loaded_prices(backend: "Backend") -> Prices | None:
    """litellm's prices for a hosted ``backend`` (its 1-hour write price under ``cache_retention="1h"``); None when
    self-hosted, unpriced, or litellm is not loaded yet."""
    if backend.self_hosted or "litellm" not in sys.modules:
        return None
    return prices_for(backend.model, ttl_1h=backend.cache_retention == "1h")


def account(stats: "SessionStats", backend: "Backend", usage: Usage, *, warm: bool = False, escalation: bool = False,
            session: str | None = None) -> None:
    """A hosted answer's cache tokens and dollars into ``stats``; a warm's and an escalation's shares apart. Never
    raises: an answer's accounting is diagnostics, and a turn never fails for it."""
    if backend.self_hosted:
        return
    try:
        _account(stats, backend, usage, warm=warm, escalation=escalation, session=session)
    except Exception as exc:
        emit("cost_unread", level="warning", backend=backend.label, error=type(exc).__name__, session=session)


def _account(stats: "SessionStats", backend: "Backend", usage: Usage, *, warm: bool, escalation: bool,
             session: str | None) -> None:
    tokens = cache_usage(usage)
    stats.add("cache_write_tokens", tokens.cache_write)
    stats.add("cache_read_tokens", tokens.cache_read)
    if warm:
        stats.add("warm_cache_write_tokens", tokens.cache_write)
    if escalation:
        stats.add("escalation_cache_read_tokens", tokens.cache_read)
    prices = loaded_prices(backend)
    cost = saved = None
    if prices is not None:
        cost, saved = request_cost(tokens, prices), read_saving(tokens, prices)
        stats.add_usd("cost_usd", cost)
        stats.add_usd("cache_saved_usd", saved)
        if warm:
            stats.add_usd("warm_cost_usd", cost)
        if escalation:
            stats.add_usd("escalation_saved_usd", saved)
    emit("warm_cost" if warm else "hosted_cache", backend=backend.label, prompt=tokens.prompt_tokens,
         cache_write=tokens.cache_write, cache_read=tokens.cache_read, cost_usd=cost, saved_usd=saved,
         escalation=escalation or None, session=session)
