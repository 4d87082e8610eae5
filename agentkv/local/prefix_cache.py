"""A vLLM-style prefix cache: KV in fixed-size blocks, keyed by a hash chain, evicted LRU under a byte budget.

Each full block of ``block_size`` tokens is keyed by ``sha256(parent hash, cache salt, the block's token ids)``,
so a block's key names its whole prefix, and requests with different salts never share a block. Only full
blocks are cached. A request reuses the longest run of cached leading blocks and computes the rest.

Eviction is least-recently-used; when a chain is used its blocks are touched tail-first, so that under pressure
the tail of a prefix goes before its head (the head is what the next request most likely shares).

Not thread-safe: :class:`~agentkv.local.engine.LocalEngine` calls it under its request lock.

Usage::

    cache = PrefixCache(block_size=16, budget_bytes=256 << 20)
    hashes = cache.hashes(token_ids, salt="tenant-a")
    blocks = cache.match(hashes)                 # the longest cached leading run
    cache.insert(hashes, lambda i: make_block(i))
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


_ROOT = hashlib.sha256(b"agentkv-prefix-cache-v1").digest()


@dataclass(frozen=True)
class KVBlock:
    """One block of cached KV for every layer.

    keys: ``[layers, kv_heads, block_size, head_dim]`` (post-RoPE, as the model caches them).
    values: same shape as ``keys``.
    """

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held by this block's keys and values."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def _salt_bytes(salt: str | None) -> bytes:
    """A stable, unambiguous encoding of a salt: None and "" differ, and no salt is a prefix of another."""
    if salt is None:
        return b"\x00"
    raw = salt.encode("utf-8")
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


def block_hash(parent: bytes, token_ids: Sequence[int], salt: str | None) -> bytes:
    """The key of one block: sha256 over its parent's key, the salt and its token ids."""
    digest = hashlib.sha256(parent)
    digest.update(_salt_bytes(salt))
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return digest.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Keys of every full block of ``token_ids``, each chained to the one before it."""
    hashes: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Blocks of KV keyed by hash chain, LRU-evicted to stay within ``budget_bytes``."""

    def __init__(self, *, block_size: int = 16, budget_bytes: int = 512 << 20) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.budget_bytes = max(0, int(budget_bytes))
        self.bytes_used = 0
        self.evictions = 0
        self._blocks: OrderedDict[bytes, KVBlock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        """Keys of every full block of ``token_ids`` under ``salt``."""
        return chain_hashes(token_ids, self.block_size, salt)

    def match(self, hashes: Sequence[bytes]) -> list[KVBlock]:
        """The cached blocks for the longest leading run of ``hashes``; marks them recently used."""
        found: list[KVBlock] = []
        for key in hashes:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        self._touch(hashes[: len(found)])
        return found

    def insert(self, hashes: Sequence[bytes], block_at: Callable[[int], KVBlock]) -> int:
        """Cache the blocks of a chain that are missing, building block ``i`` with ``block_at(i)``.

        Stops early when the budget cannot hold more without evicting this chain's own blocks.
        Returns the number of leading blocks of the chain that are cached afterwards.
        """
        chain = set(hashes)
        self._touch([key for key in hashes if key in self._blocks])
        for index, key in enumerate(hashes):
            if key not in self._blocks and not self._add(key, block_at(index), chain):
                break
        self._touch([key for key in hashes if key in self._blocks])
        return self._leading(hashes)

    def resize(self, budget_bytes: int) -> None:
        """Change the budget, evicting least-recently-used blocks until the cache fits."""
        self.budget_bytes = max(0, int(budget_bytes))
        self._evict_until(0, protected=set())

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.bytes_used = 0

    def _leading(self, hashes: Sequence[bytes]) -> int:
        count = 0
        while count < len(hashes) and hashes[count] in self._blocks:
            count += 1
        return count

    def _add(self, key: bytes, block: KVBlock, protected: set[bytes]) -> bool:
        size = block.nbytes
        if not self._evict_until(size, protected):
            return False
        self._blocks[key] = block
        self.bytes_used += size
        return True

    def _evict_until(self, incoming: int, protected: set[bytes]) -> bool:
        """Evict LRU blocks outside ``protected`` until ``incoming`` more bytes fit; False if impossible."""
        while self.bytes_used + incoming > self.budget_bytes:
            oldest = next(iter(self._blocks), None)
            if oldest is None or oldest in protected:
                return False
            self.bytes_used -= self._blocks.pop(oldest).nbytes
            self.evictions += 1
        return True

    def _touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, tail first, so its head ends up most recently used."""
        for key in reversed(hashes):
            self._blocks.move_to_end(key)
