"""Per-token keys and values in and out of a paged KV cache whose block interior only its writer knows.

vLLM's CPU cache is one tensor per layer, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, and inside a
block the element order depends on dtype and instruction set (float32 keys are stored transposed; bf16 on
AMX in tiles). Writing goes through the attention backend's own writer. Reading needs the inverse, which vLLM
does not have: :class:`PagedLayout` derives it from the writer by writing numbered probes into one scratch
block and reading where each number landed. Any layout the writer produces is read back exactly.

    layout = PagedLayout.probe(writer, kv_heads=2, block_size=128, head_dim=32, dtype=torch.float32)
    keys, values = layout.read(kv_cache, block_ids, n)            # [n, kv_heads, head_dim] each
    layout.write(writer, kv_cache, block_ids, start, keys, values)  # tokens start .. start + len(keys)

``writer(kv_cache, keys, values, slots)``: keys/values [tokens, kv_heads, head_dim], slots [tokens] int64,
slot = block_id * block_size + offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["PagedLayout", "Writer", "slot_mapping"]

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_EXACT_INTEGERS = {torch.float32: 1 << 24, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int, device: torch.device | None = None
                 ) -> torch.Tensor:
    """The cache slots of tokens ``start .. end-1`` of a request whose blocks are ``block_ids``: [end-start] int64."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(list(block_ids), dtype=torch.int64)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)


@dataclass(frozen=True)
class PagedLayout:
    """Where each token's keys and values sit inside one block, flattened.

    key_index, value_index: [block_size * kv_heads * head_dim] int64: element ``(t, h, d)`` of a block's
    keys (values) is at flat offset ``key_index[(t * kv_heads + h) * head_dim + d]`` of the block.
    """

    kv_heads: int
    block_size: int
    head_dim: int
    key_index: torch.Tensor
    value_index: torch.Tensor

    @classmethod
    def probe(cls, writer: Writer, *, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str | None = None) -> PagedLayout:
        """Derive the layout by writing numbered tokens through ``writer`` into a scratch block of ``dtype``."""
        count = block_size * kv_heads * head_dim
        base = _EXACT_INTEGERS.get(dtype)
        if base is None:
            raise TypeError(f"cannot probe a {dtype} cache: its values are not exact small integers")
        radix = base - 1  # digits 1 .. radix; 0 marks an element the writer did not fill
        codes = torch.arange(count, dtype=torch.int64)
        key_code = torch.zeros(2 * count, dtype=torch.int64)
        value_code = torch.zeros(2 * count, dtype=torch.int64)
        for digit in range(_digits(count, radix)):
            place = (codes // radix**digit) % radix + 1  # this digit of every element's code, as 1 .. radix
            flat = _written(writer, place.view(block_size, kv_heads, head_dim), dtype, device)  # (H*BS*2D,)
            key_code += (flat - 1).clamp(min=0) * radix**digit
            value_code += (-flat - 1).clamp(min=0) * radix**digit
        return cls(kv_heads, block_size, head_dim, _invert(key_code, flat > 0, count),
                   _invert(value_code, flat < 0, count))

    def read(self, kv_cache: torch.Tensor, block_ids: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` tokens' keys and values of a request whose blocks are ``block_ids``.

        kv_cache: [num_blocks, kv_heads, block_size, 2 * head_dim] -> two [n, kv_heads, head_dim]
        """
        used = list(block_ids[: math.ceil(n / self.block_size)])
        index = torch.tensor(used, dtype=torch.int64, device=kv_cache.device)
        blocks = kv_cache.index_select(0, index).reshape(len(used), -1)  # (B, H, BS, 2D) -> (B, H*BS*2D)
        shape = (len(used) * self.block_size, self.kv_heads, self.head_dim)
        keys = blocks.index_select(1, self.key_index.to(kv_cache.device)).reshape(shape)[:n]
        values = blocks.index_select(1, self.value_index.to(kv_cache.device)).reshape(shape)[:n]
        return keys, values

    def write(self, writer: Writer, kv_cache: torch.Tensor, block_ids: Sequence[int], start: int,
              keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens ``start .. start + len(keys) - 1`` through ``writer``. keys/values: [tokens, kv_heads, head_dim]."""
        slots = slot_mapping(block_ids, self.block_size, start, start + keys.shape[0], kv_cache.device)
        writer(kv_cache, keys.to(kv_cache.device, kv_cache.dtype).contiguous(),
               values.to(kv_cache.device, kv_cache.dtype).contiguous(), slots)


def _digits(count: int, base: int) -> int:
    digits = 1
    while base**digits < count:
        digits += 1
    return digits


def _written(writer: Writer, place: torch.Tensor, dtype: torch.dtype, device: torch.device | str | None
             ) -> torch.Tensor:
    """One block after writing keys ``place`` and values ``-place`` ([block_size, kv_heads, head_dim]), flattened."""
    block_size, kv_heads, head_dim = place.shape
    scratch = torch.zeros(1, kv_heads, block_size, 2 * head_dim, dtype=dtype, device=device)
    probe_keys = place.to(device=device, dtype=dtype)
    writer(scratch, probe_keys, -probe_keys, torch.arange(block_size, dtype=torch.int64, device=device))
    flat = scratch.reshape(-1).to("cpu", torch.float64).round().long()
    count = place.numel()
    if int((flat > 0).sum()) != count or int((flat < 0).sum()) != count:
        raise ValueError(f"the writer filled {int((flat > 0).sum())} key and {int((flat < 0).sum())} value "
                         f"elements of a block, expected {count} each")
    return flat


def _invert(code: torch.Tensor, filled: torch.Tensor, count: int) -> torch.Tensor:
    """code[offset] for the filled offsets -> offset_of[code], [count] int64 (a permutation's inverse)."""
    offsets = torch.nonzero(filled).squeeze(1)
    found = code[offsets]
    if not torch.equal(torch.sort(found).values, torch.arange(count)):
        raise ValueError("the writer's layout is not a one-to-one placement of a block's elements")
    return torch.empty(count, dtype=torch.int64).index_put_((found,), offsets)
