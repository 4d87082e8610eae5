"""A vLLM-style prefix cache: KV in fixed-size blocks, keyed by a hash chain, evicted under a byte (or block) bound.

Each full block of ``block_size`` tokens is keyed by ``sha256(parent hash, cache salt, the block's token ids)``,
so a block's key names its whole prefix, and requests with different salts never share a block. Only full
blocks are cached. A request reuses the longest run of cached leading blocks and computes the rest.

Eviction (:mod:`agentkv.embedded.engine.eviction`) is tenant-fair by default: the salt group furthest over its fair share
loses its coldest block; ``policy="lru"`` evicts the coldest block of all, as vLLM does. Either way, when a chain is
used its blocks are touched tail-first, so that under pressure the tail of a prefix goes before its head (the head
is what the next request most likely shares), and blocks a running request has pinned are never evicted.

Not thread-safe: :class:`~agentkv.embedded.engine.LocalEngine` calls it under its request lock.

With ``on_events`` set, each operation that changes what the cache holds reports it once, as a list of
:class:`CacheEvent` (the server's KV-event publisher, :mod:`agentkv.embedded.server.kv_events`, sets it and publishes them the
way vLLM does); unset, it costs nothing.

Usage::

    cache = PrefixCache(block_size=16, budget_bytes=256 << 20, policy="fair")
    hashes = cache.hashes(token_ids, salt="tenant-a")
    blocks = cache.match(hashes)                 # the longest cached leading run
    cache.insert(hashes, lambda i: make_block(i))
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from agentkv.embedded.engine.eviction import EvictionPolicy, GroupFacts, check_policy, victim_group

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


class PrefixCache:
    """Blocks of KV keyed by hash chain, evicted by ``policy`` to stay within ``budget_bytes`` (and ``num_blocks``).

    Blocks a running request :meth:`pin`-s are in use (vLLM: ``ref_cnt > 0``) and never evicted until it
    :meth:`unpin`-s them; the rest are ordered coldest first per salt group, and :func:`victim_group` picks whose
    coldest block goes (``"fair"``: the salt furthest over its fair share; ``"lru"``: the coldest of all).
    """

    def __init__(self, *, block_size: int = 16, budget_bytes: int = 512 << 20, num_blocks: int | None = None,
                 policy: str = "fair") -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if num_blocks is not None and num_blocks < 0:
            raise ValueError("num_blocks must be at least 0")
        self.block_size = block_size
        self.budget_bytes = max(0, int(budget_bytes))
        self.num_blocks = num_blocks
        self.policy: EvictionPolicy = check_policy(policy)
        self.bytes_used = 0
        self.evictions = 0
        self._blocks: dict[bytes, KVBlock] = {}
        self._salt: dict[bytes, str | None] = {}
        self._tick: dict[bytes, int] = {}  # when each block was last used; larger is warmer
        self._clock = 0
        self._free: dict[str | None, OrderedDict[bytes, None]] = {}  # evictable blocks per group, coldest first
        self._used: dict[str | None, int] = {}  # bytes each group holds, in use or not
        self._refs: dict[bytes, int] = {}  # running requests using each pinned block
        self._epoch = 0  # bumped by clear(): pins taken before it are void
        self.on_events: Callable[[list[CacheEvent]], None] | None = None
        self._evicted: list[bytes] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def keys(self) -> list[bytes]:
        """The cached blocks' keys, least recently used first."""
        return sorted(self._blocks, key=self._tick.__getitem__)

    def group_bytes(self) -> dict[str | None, int]:
        """Bytes each salt group holds (None: unsalted requests)."""
        return dict(self._used)

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

        Stops early when the pool cannot hold more without evicting this chain's own blocks or blocks in use.
        Returns the number of leading blocks of the chain that are cached afterwards. If ``block_at`` raises, what
        was added and evicted before is kept and reported, and the error propagates.
        """
        chain = set(hashes)
        salt: str | None = getattr(hashes, "salt", None)
        self._touch([key for key in hashes if key in self._blocks])
        added: list[int] = []
        try:
            for index, key in enumerate(hashes):
                if key not in self._blocks:
                    if not self._add(key, block_at(index), salt, chain):
                        break
                    added.append(index)
            self._touch([key for key in hashes if key in self._blocks])
        finally:
            if self.on_events is not None:
                self._report(_stored_runs(hashes, added, self.block_size))
        return self._leading(hashes)

    def pin(self, hashes: Sequence[bytes]) -> tuple[int, list[bytes]]:
        """Mark the resident blocks of a chain in use by a running request; pass the result to :meth:`unpin`."""
        pinned = [key for key in hashes if key in self._blocks]
        for key in pinned:
            if self._refs.get(key, 0) == 0:
                self._free[self._salt[key]].pop(key, None)
            self._refs[key] = self._refs.get(key, 0) + 1
        return self._epoch, pinned

    def unpin(self, pins: tuple[int, list[bytes]]) -> None:
        """Release a request's blocks: each becomes evictable again, the chain's tail colder than its head."""
        epoch, keys = pins
        if epoch != self._epoch:
            return
        for key in reversed(keys):
            refs = self._refs.pop(key, 0) - 1
            if refs > 0:
                self._refs[key] = refs
            elif key in self._blocks:
                self._tick[key] = self._next_tick()
                self._free[self._salt[key]][key] = None

    def resize(self, budget_bytes: int, num_blocks: int | None | EllipsisType = ...) -> None:
        """Change the budget (and the block bound, when given; None lifts it), evicting by the policy until the
        cache fits."""
        self.budget_bytes = max(0, int(budget_bytes))
        if not isinstance(num_blocks, EllipsisType):
            self.num_blocks = num_blocks
        self._evict_until(0, protected=set())
        if self.on_events is not None:
            self._report([])

    def clear(self) -> None:
        """Drop every block (pins taken before are void)."""
        for table in (self._blocks, self._salt, self._tick, self._free, self._used, self._refs):
            table.clear()  # type: ignore[attr-defined]
        self.bytes_used = 0
        self._epoch += 1
        self._evicted.clear()
        if self.on_events is not None:
            self.on_events([CacheEvent("cleared")])

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

    def _next_tick(self) -> int:
        self._clock += 1
        return self._clock

    def _add(self, key: bytes, block: KVBlock, salt: str | None, protected: set[bytes]) -> bool:
        size = block.nbytes
        if not self._evict_until(size, protected, incoming_blocks=1, salt=salt):
            return False
        self._blocks[key], self._salt[key], self._tick[key] = block, salt, self._next_tick()
        self._free.setdefault(salt, OrderedDict())[key] = None
        self._used[salt] = self._used.get(salt, 0) + size
        self.bytes_used += size
        return True

    def _full(self, incoming: int, incoming_blocks: int) -> bool:
        over_blocks = self.num_blocks is not None and len(self._blocks) + incoming_blocks > self.num_blocks
        return over_blocks or self.bytes_used + incoming > self.budget_bytes

    def _evict_until(self, incoming: int, protected: set[bytes], incoming_blocks: int = 0,
                     salt: str | None = None) -> bool:
        """Evict by the policy, never ``protected`` or pinned blocks, until ``incoming`` more bytes (and
        ``incoming_blocks`` more blocks, inserted under ``salt``) fit; False if impossible."""
        while self._full(incoming, incoming_blocks):
            inserting = GroupFacts(salt, self._used.get(salt, 0), 0) if incoming_blocks else None
            groups = len(self._used.keys() | {salt}) if inserting else len(self._used)
            coldest = self._coldest(protected)
            victim = victim_group(self.policy, [GroupFacts(group, self._used[group], self._tick[key])
                                                for group, key in coldest.items()],
                                  capacity=self._capacity(incoming), groups=groups, incoming=inserting)
            if victim is None:
                return False
            self._evict(coldest[victim.group])  # type: ignore[index]
        return True

    def _coldest(self, protected: set[bytes]) -> dict[str | None, bytes]:
        """Each group's coldest evictable block outside ``protected``."""
        out: dict[str | None, bytes] = {}
        for salt, free in self._free.items():
            key = next((key for key in free if key not in protected), None)
            if key is not None:
                out[salt] = key
        return out

    def _capacity(self, incoming: int) -> int:
        """Bytes the pool holds when full (for fair shares)."""
        if self.num_blocks is None:
            return self.budget_bytes
        block_bytes = incoming or (self.bytes_used // max(len(self._blocks), 1))
        return min(self.budget_bytes, self.num_blocks * block_bytes)

    def _evict(self, key: bytes) -> None:
        salt = self._salt.pop(key)
        size = self._blocks.pop(key).nbytes
        del self._tick[key]
        free = self._free[salt]
        del free[key]
        self._used[salt] -= size
        if not self._used[salt] and not free:
            del self._used[salt], self._free[salt]
        self.bytes_used -= size
        self.evictions += 1
        if self.on_events is not None:
            self._evicted.append(key)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, tail first, so its head ends up most recently used."""
        for key in reversed(hashes):
            self._tick[key] = self._next_tick()
            free = self._free[self._salt[key]]
            if key in free:
                free.move_to_end(key)


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
