"""One server's resident block tree, rebuilt from vLLM's KV events (pure: no sockets, no clock).

A ``BlockStored`` names each block by an opaque hash, its parent's hash and its tokens; a block is found again
by *what it holds*: ``(parent hash, token ids, extra keys)``, or at a chain's root ``(salt-bearing extra keys,
token ids)``. So a prompt is walked block by block without re-deriving the server's hash function, and two
salts never meet: the salt rides in the root block's extra keys (vLLM's ``generate_block_hash_extra_keys``) and
every child is keyed by its parent. Blocks whose extra keys carry more than a salt (LoRA, multimodal) are kept
but never match a text prompt, as on the server.

Memory is bounded: past ``max_blocks`` the coldest blocks are forgotten (counted in ``forgotten``); the tree
then under-reports residency rather than inventing it.

Usage::

    tree = BlockTree(max_blocks=1 << 20)
    tree.apply(decoded_batch_events, now=ts)
    tree.resident_tokens(token_ids, salt="tenant-a-salt")
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Mapping, Sequence

__all__ = ["Block", "BlockTree", "event_fields"]

_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
           "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED = ("block_hashes", "medium", "group_idx")


@dataclass(slots=True)
class Block:
    """One resident block: where it hangs, what it holds, whose it is, when it was last stored or used."""

    parent: Hashable | None
    key: tuple[Any, ...]
    tokens: int
    depth: int
    salt: str | None
    last_used: float
    stored_at: float = 0.0  # the publisher's clock when the block was stored (``as_of`` reads compare it)


def _chunk(tokens: Sequence[int]) -> bytes | tuple[int, ...]:
    """A block's token ids as a compact key: 4 bytes a token (a tuple for ids outside uint32)."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        return tuple(tokens)


def _freeze(value: Any) -> Any:
    """A hashable copy of a decoded msgpack value (lists become tuples, bytes stay bytes)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """``(type, fields)`` of one decoded event: a tagged map (current vLLM) or a tagged array (before #42892)."""
    if isinstance(event, Mapping):
        return str(event.get("type")), dict(event)
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        names = _STORED if event[0] == "BlockStored" else _REMOVED if event[0] == "BlockRemoved" else ()
        return event[0], dict(zip(names, event[1:]))
    return "", {}


def _salt_of(extra: Any, lora_name: Any) -> str | None:
    """The cache salt in a root block's extra keys: its last string, after any LoRA name."""
    if not isinstance(extra, (list, tuple)):
        return None
    strings = [v for v in extra if isinstance(v, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[-1] if strings else None


class BlockTree:
    """The blocks one server holds on its GPU, keyed by hash and findable by content."""

    def __init__(self, *, max_blocks: int = 1 << 20) -> None:
        self.max_blocks = max(1, int(max_blocks))
        self.blocks: dict[Hashable, Block] = {}
        self._by_key: dict[tuple[Any, ...], Hashable] = {}
        self.block_size: int | None = None
        self.forgotten = 0
        self.resets = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def apply(self, events: Sequence[Any], *, now: float) -> None:
        """Apply one batch's events in order."""
        for event in events:
            kind, fields = event_fields(event)
            if kind == "BlockStored":
                self._stored(fields, now)
            elif kind == "BlockRemoved":
                self._removed(fields)
            elif kind == "AllBlocksCleared":
                self.clear()

    def clear(self) -> None:
        """Forget every block (``AllBlocksCleared``, or a publisher that restarted)."""
        self.blocks.clear()
        self._by_key.clear()
        self.resets += 1

    def _stored(self, fields: dict[str, Any], now: float) -> None:
        if fields.get("medium") not in (None, "GPU") or fields.get("group_idx") not in (None, 0):
            return  # another tier or KV cache group: not what a request's prefill reuses
        hashes = [_freeze(h) for h in fields.get("block_hashes") or ()]
        size = int(fields.get("block_size") or 0)
        tokens = list(fields.get("token_ids") or ())
        if not hashes or size < 1 or len(tokens) != size * len(hashes):
            return  # a shape this ledger cannot key (sliding window, placeholders)
        self.block_size = size
        extras = list(fields.get("extra_keys") or [None] * len(hashes))
        parent = _freeze(fields.get("parent_block_hash"))
        for index, block_hash in enumerate(hashes):
            extra = _freeze(extras[index]) if index < len(extras) else None
            chunk = _chunk(tokens[index * size : (index + 1) * size])
            up = self.blocks.get(parent) if parent is not None else None
            if parent is not None and up is None:
                parent = block_hash
                continue  # the parent is unknown (forgotten or before a gap): this chain cannot be walked
            key = (parent, chunk, extra) if up is not None else ("root", chunk, extra)
            salt = up.salt if up is not None else _salt_of(extra, fields.get("lora_name"))
            self._put(block_hash, Block(parent, key, size, up.depth + 1 if up else 0, salt, now, now))
            parent = block_hash
        self._bound()

    def _put(self, block_hash: Hashable, block: Block) -> None:
        old = self.blocks.pop(block_hash, None)
        if old is not None:
            self._by_key.pop(old.key, None)
        self.blocks[block_hash] = block
        self._by_key[block.key] = block_hash

    def _removed(self, fields: dict[str, Any]) -> None:
        if fields.get("medium") not in (None, "GPU") or fields.get("group_idx") not in (None, 0):
            return
        for block_hash in fields.get("block_hashes") or ():
            block = self.blocks.pop(_freeze(block_hash), None)
            if block is not None:
                self._by_key.pop(block.key, None)

    def _bound(self) -> None:
        """Past ``max_blocks``, forget the coldest blocks (deepest first among equals) down to 90% of it."""
        if len(self.blocks) <= self.max_blocks:
            return
        excess = len(self.blocks) - self.max_blocks * 9 // 10  # make room for a while: one sort per 10% churn
        for block_hash, _ in self.coldest()[:excess]:
            block = self.blocks.pop(block_hash)
            self._by_key.pop(block.key, None)
            self.forgotten += 1

    def chain(self, token_ids: Sequence[int], salt: str | None, as_of: float | None = None) -> Iterator[Hashable]:
        """The resident blocks of ``token_ids``' leading full blocks under ``salt``, in order (only those stored
        at or before ``as_of``, when given: what a request sent then found)."""
        size = self.block_size
        if size is None:
            return
        parent: Hashable | None = None
        for start in range(0, len(token_ids) - size + 1, size):
            chunk = _chunk(token_ids[start : start + size])
            key = ("root", chunk, (salt,) if salt else None) if parent is None else (parent, chunk, None)
            found = self._by_key.get(key)
            if found is None or (as_of is not None and self.blocks[found].stored_at > as_of):
                return
            yield found
            parent = found

    def resident_tokens(self, token_ids: Sequence[int], salt: str | None, as_of: float | None = None) -> int:
        """Leading tokens of a prompt a request would find cached: full blocks within all but its last token.

        vLLM always computes a prompt's last token, so a hit stops one token short of the prompt's end.
        ``as_of``: ignore blocks stored after that publisher time (a request sent then could not find them).
        """
        head = list(token_ids)[: max(0, len(token_ids) - 1)]
        return sum(1 for _ in self.chain(head, salt, as_of)) * (self.block_size or 0)

    def held_tokens(self, token_ids: Sequence[int], salt: str | None) -> int:
        """Leading tokens of ``token_ids`` held in full blocks (a warmed prefix: its last token counts too)."""
        return sum(1 for _ in self.chain(list(token_ids), salt)) * (self.block_size or 0)

    def touch(self, token_ids: Sequence[int], salt: str | None, now: float) -> int:
        """Mark a prompt's resident blocks used at ``now`` (a request just read them); returns how many."""
        found = list(self.chain(list(token_ids), salt))
        for block_hash in found:
            self.blocks[block_hash].last_used = now
        return len(found)

    def coldest(self, salts: set[str | None] | None = None) -> list[tuple[Hashable, Block]]:
        """Blocks (of ``salts`` only, when given) coldest first; among equally cold ones, a chain's tail first."""
        items = [(h, b) for h, b in self.blocks.items() if salts is None or b.salt in salts]
        items.sort(key=lambda item: (item[1].last_used, -item[1].depth))
        return items
