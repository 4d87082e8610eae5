"""Handoff between two local engines: map the source's cached prefix into the target's prefix cache.

The engines need two methods (``agentkv.embedded``'s engine has them)::

    engine.cached_prefix_kv(token_ids, cache_salt=None) -> (n_tokens, keys_per_layer, values_per_layer)
    engine.install_prefix_kv(token_ids, keys, values, cache_salt=None) -> int | None  # tokens installed

keys/values per layer: [1, kv_heads, n_tokens, head_dim], post-RoPE at positions ``0..n_tokens-1``.
The engine's model signature comes from ``engine.kv_signature`` if it has one, else ``engine.model``.

    plan = choose_handoff(mapper, min_attention_cosine=0.95)
    result = handoff_prefix(fast, slow, token_ids, plan.mapper, cache_salt=salt)   # mapper None -> replay
    # the target then prefills only token_ids[result.mapped_tokens:]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from agentkv.handoff.cache import KVCache
from agentkv.handoff.errors import HandoffError
from agentkv.handoff.protocol import KVMapper
from agentkv.handoff.signature import ModelSignature


class PrefixKVEngine(Protocol):
    """What ``handoff_prefix`` needs from an engine."""

    def cached_prefix_kv(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[int, Any, Any]: ...

    def install_prefix_kv(
        self, token_ids: Sequence[int], keys: Any, values: Any, cache_salt: str | None = None
    ) -> Any: ...


@dataclass(frozen=True)
class HandoffResult:
    """What a handoff did: the target now holds KV for ``token_ids[:mapped_tokens]``."""

    mapped_tokens: int
    backend: str
    reason: str
    map_ms: float = 0.0
    bytes_moved: int = 0

    @property
    def replayed(self) -> bool:
        """True when no KV moved and the target prefills everything itself."""
        return self.mapped_tokens == 0


def engine_signature(engine: Any) -> ModelSignature:
    """The signature of the model an engine runs (``engine.kv_signature`` or ``engine.model``)."""
    from agentkv.handoff.models import signature_of

    declared = getattr(engine, "kv_signature", None)
    return declared if isinstance(declared, ModelSignature) else signature_of(engine.model)


def handoff_prefix(
    source_engine: PrefixKVEngine,
    target_engine: PrefixKVEngine,
    token_ids: Sequence[int],
    mapper: KVMapper | None,
    cache_salt: str | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> HandoffResult:
    """Map the source engine's cached KV for ``token_ids`` and install it in the target's prefix cache.

    A mapper of None or one that moves no KV (``replay``) is a no-op. A mapper that refuses the cache
    (another model's, say) falls back to replay with the reason logged; other errors propagate.
    """
    if mapper is None or not mapper.moves_kv:
        return HandoffResult(0, "replay", "replay: the target prefills the tokens")
    n, keys, values = source_engine.cached_prefix_kv(token_ids, cache_salt=cache_salt)
    if n == 0:
        return _logged(HandoffResult(0, mapper.name, "the source engine has no cached prefix"))
    try:
        started = clock()
        cache = KVCache.from_layers(keys, values, engine_signature(source_engine))
        mapped = mapper.map(cache)
        map_ms = (clock() - started) * 1000.0
    except HandoffError as error:
        return _logged(HandoffResult(0, "replay", f"mapper {mapper.name!r} refused: {error}"), fallback=True)
    installed = target_engine.install_prefix_kv(list(token_ids[:n]), mapped.keys, mapped.values, cache_salt=cache_salt)
    tokens = installed if isinstance(installed, int) else n
    return _logged(HandoffResult(tokens, mapper.name, f"mapped {n} cached tokens", map_ms, mapped.nbytes))


def _logged(result: HandoffResult, fallback: bool = False) -> HandoffResult:
    from agentkv.events import emit

    event, level = ("handoff.fallback", "warning") if fallback else ("handoff.prefix", "info")
    emit(event, level, backend=result.backend, mapped_tokens=result.mapped_tokens, reason=result.reason,
         map_ms=round(result.map_ms, 3), bytes=result.bytes_moved)
    return result
