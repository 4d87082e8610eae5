"""``KVCache``: one model's keys and values, per layer, with the positions they were computed at.

Importing this module does not import torch; the tensors are whatever the caller hands in.

    cache = KVCache.from_dynamic_cache(out.cache, ModelSignature.from_config(model.config))
    out = model(next_ids, cache=cache.to_dynamic_cache(), use_cache=True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from agentkv.handoff.errors import SignatureMismatchError
from agentkv.handoff.signature import ModelSignature

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVCache:
    """Post-RoPE keys and values of every layer of one model.

    keys[i], values[i]: [batch, kv_heads, seq, head_dim], one entry per layer.
    positions: [batch, seq] int64, the RoPE position of every cached token.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: torch.Tensor
    signature: ModelSignature

    def __post_init__(self) -> None:
        sig = self.signature
        if len(self.keys) != sig.num_layers or len(self.values) != sig.num_layers:
            raise SignatureMismatchError(
                f"{len(self.keys)} key / {len(self.values)} value layers for {sig.describe()}"
            )
        expected = (sig.kv_heads, sig.head_dim)
        for t in (*self.keys, *self.values):
            if t.dim() != 4 or (t.shape[1], t.shape[3]) != expected:
                raise SignatureMismatchError(f"a layer of shape {tuple(t.shape)} for {sig.describe()}")

    @property
    def seq_len(self) -> int:
        """Number of cached tokens."""
        return int(self.keys[0].shape[2])

    @property
    def batch(self) -> int:
        """Batch size."""
        return int(self.keys[0].shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def to(self, device: Any = None, dtype: Any = None) -> KVCache:
        """The same cache on another device and/or dtype (positions keep their dtype)."""
        keys = tuple(k.to(device=device, dtype=dtype) for k in self.keys)
        values = tuple(v.to(device=device, dtype=dtype) for v in self.values)
        return replace(self, keys=keys, values=values, positions=self.positions.to(device=device))

    def prefix(self, n: int) -> KVCache:
        """The first ``n`` cached tokens."""
        keys = tuple(k[:, :, :n] for k in self.keys)
        values = tuple(v[:, :, :n] for v in self.values)
        return replace(self, keys=keys, values=values, positions=self.positions[:, :n])

    @classmethod
    def from_layers(
        cls,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        signature: ModelSignature,
        positions: torch.Tensor | None = None,
    ) -> KVCache:
        """Wrap per-layer tensors; ``positions`` default to ``0..seq-1`` for every batch row."""
        if positions is None:
            positions = default_positions(keys[0])
        return cls(tuple(keys), tuple(values), positions, signature)

    @classmethod
    def from_dynamic_cache(
        cls, cache: Any, signature: ModelSignature, positions: torch.Tensor | None = None
    ) -> KVCache:
        """Read a transformers ``DynamicCache`` (v5: ``cache.layers[i].keys`` / ``.values``)."""
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return cls.from_layers(keys, values, signature, positions)

    def to_dynamic_cache(self, config: Any = None) -> Any:
        """A transformers ``DynamicCache`` holding these tensors (not copies)."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=list(zip(self.keys, self.values, strict=True)), config=config)


def default_positions(keys: torch.Tensor) -> torch.Tensor:
    """``0..seq-1`` for every row: [batch, seq] int64 on the keys' device.

    keys: [batch, kv_heads, seq, head_dim]
    """
    import torch

    batch, _, seq, _ = keys.shape
    return torch.arange(seq, device=keys.device).expand(batch, seq)
