"""Moving KV between the prefix cache's blocks and a transformers ``DynamicCache``.

Shapes used throughout:

- a layer of a transformers cache, and the per-layer lists of the public API: ``[1, kv_heads, seq, head_dim]``;
- a cached block (:class:`~agentkv.embedded.engine.prefix_cache.KVBlock`): ``[layers, kv_heads, block_size, head_dim]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from agentkv.embedded.engine.prefix_cache import KVBlock

if TYPE_CHECKING:
    import torch


def stack_blocks(blocks: Sequence[KVBlock]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values ``[1, kv_heads, n_blocks*block_size, head_dim]`` of consecutive blocks."""
    import torch

    if not blocks:
        return [], []
    keys = torch.cat([b.keys for b in blocks], dim=2)  # (layers, H, n*B, D)
    values = torch.cat([b.values for b in blocks], dim=2)
    return [k.unsqueeze(0) for k in keys], [v.unsqueeze(0) for v in values]  # layers x (1, H, n*B, D)


def cache_from_blocks(blocks: Sequence[KVBlock], config: Any) -> Any:
    """A ``DynamicCache`` for ``config``'s model holding ``blocks`` as its first tokens (empty when none)."""
    from transformers import DynamicCache

    keys, values = stack_blocks(blocks)
    if not keys:
        return DynamicCache(config=config)
    return DynamicCache(list(zip(keys, values, strict=True)), config=config)


def layer_kv(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values ``[1, kv_heads, seq, head_dim]`` held by a transformers cache."""
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def block_from_layers(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], index: int, block_size: int
) -> KVBlock:
    """Block ``index`` cut out of per-layer ``[1, kv_heads, seq, head_dim]`` tensors, copied.

    The copy matters: a view would keep the whole request's KV alive for as long as the block is cached.
    """
    import torch

    span = slice(index * block_size, (index + 1) * block_size)
    block_keys = torch.stack([k[0, :, span] for k in keys])  # layers x (H, B, D) -> (layers, H, B, D)
    block_values = torch.stack([v[0, :, span] for v in values])
    return KVBlock(block_keys, block_values)


def check_layer_shapes(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], *, layers: int, kv_heads: int, head_dim: int
) -> int:
    """The token count shared by every ``[1, kv_heads, seq, head_dim]`` tensor; ValueError if they disagree."""
    if len(keys) != layers or len(values) != layers:
        raise ValueError(f"expected {layers} layers of keys and values, got {len(keys)} and {len(values)}")
    seq = keys[0].shape[2]
    for tensor in (*keys, *values):
        if tuple(tensor.shape) != (1, kv_heads, seq, head_dim):
            raise ValueError(f"expected [1, {kv_heads}, {seq}, {head_dim}], got {list(tensor.shape)}")
    return int(seq)
