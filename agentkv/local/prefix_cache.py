"""A vLLM-style prefix cache: KV in fixed-size blocks, keyed by a hash chain, evicted LRU under a byte budget.

Each full block of ``block_size`` tokens is keyed by ``sha256(parent hash, cache salt, the block's token ids)``,
so a block's key names its whole prefix, and requests with different salts never share a block. Only full
blocks are cached. A request reuses the longest run of cached leading blocks and computes the rest.

Eviction is least-recently-used; when a chain is used its blocks are touched tail-first, so that under pressure
the tail of a prefix goes before its head (the head is what the next request most likely shares).

Not thread-safe: :class:`~agentkv.local.engine.LocalEngine` calls it under its request lock.

With ``on_events`` set, each operation that changes what the cache holds reports it once, as a list of
:class:`CacheEvent` (what :mod:`agentkv.local.kv_events` publishes the way vLLM does); unset, it costs nothing.

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
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

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


@dataclass(frozen=True)
class CacheEvent:
    """One change to what the cache holds.

    ``stored``: a run of consecutive blocks of one chain (``hashes``, their ``token_ids``, the ``parent`` key
    before the run or None at the chain's root, and the chain's ``salt``); ``removed``: evicted ``hashes``;
    ``cleared``: every block dropped.
    """

    kind: Literal["stored", "removed", "cleared"]
    hashes: tuple[bytes, ...] = ()
    parent: bytes | None = None
    token_ids: tuple[int, ...] = ()
    salt: str | None = None


class ChainHashes(list[bytes]):
    """The keys of a chain, remembering the tokens and salt they were computed from (for events)."""

    def __init__(self, hashes: list[bytes], token_ids: Sequence[int], salt: str | None) -> None:
        super().__init__(hashes)
        self.token_ids = token_ids
        self.salt = salt


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


class _Silent:
    """The publisher when events are off."""

    def shutdown(self) -> None:
        return None


_SILENT = _Silent()


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
        self.on_events: Callable[[list[CacheEvent]], None] | None = None
        self._evicted: list[bytes] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def keys(self) -> list[bytes]:
        """The cached blocks' keys, least recently used first."""
        return list(self._blocks)

    def hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        """Keys of every full block of ``token_ids`` under ``salt``."""
        return ChainHashes(chain_hashes(token_ids, self.block_size, salt), token_ids, salt)

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
        added: list[int] = []
        for index, key in enumerate(hashes):
            if key not in self._blocks:
                if not self._add(key, block_at(index), chain):
                    break
                added.append(index)
        self._touch([key for key in hashes if key in self._blocks])
        if self.on_events is not None:
            self._report(_stored_runs(hashes, added, self.block_size))
        return self._leading(hashes)

    def resize(self, budget_bytes: int) -> None:
        """Change the budget, evicting least-recently-used blocks until the cache fits."""
        self.budget_bytes = max(0, int(budget_bytes))
        self._evict_until(0, protected=set())
        if self.on_events is not None:
            self._report([])

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.bytes_used = 0
        self._evicted.clear()
        if self.on_events is not None:
            self.on_events([CacheEvent("cleared")])

    def publish_events(self, config: Any) -> Any:
        """Publish this cache's changes as vLLM's KV events (``config``: vLLM's ``--kv-events-config``).

        Returns the publisher (``shutdown()`` it when done). ``None`` publishes nothing and imports nothing.
        """
        if config is None:
            return _SILENT
        from agentkv.local.kv_events import make_publisher

        publisher = make_publisher(config, block_size=self.block_size)
        self.on_events = publisher.publish_cache_events
        return publisher

    def _report(self, stored: list[CacheEvent]) -> None:
        """Send this operation's evictions (first: they made room) and stores, if any."""
        events = [CacheEvent("removed", tuple(self._evicted))] if self._evicted else []
        self._evicted.clear()
        if events or stored:
            assert self.on_events is not None
            self.on_events(events + stored)

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
            if self.on_events is not None:
                self._evicted.append(oldest)
        return True

    def _touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, tail first, so its head ends up most recently used."""
        for key in reversed(hashes):
            self._blocks.move_to_end(key)


def _stored_runs(hashes: Sequence[bytes], added: list[int], block_size: int) -> list[CacheEvent]:
    """One ``stored`` event per run of consecutive newly added blocks of a chain."""
    token_ids: Sequence[int] = getattr(hashes, "token_ids", ())
    salt: str | None = getattr(hashes, "salt", None)
    runs: list[list[int]] = []
    for index in added:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return [CacheEvent("stored", tuple(hashes[i] for i in run), hashes[run[0] - 1] if run[0] else None,
                       tuple(token_ids[run[0] * block_size : (run[-1] + 1) * block_size]), salt)
            for run in runs]
