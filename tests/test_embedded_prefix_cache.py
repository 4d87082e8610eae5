"""The prefix cache on its own: hash chains, salts, longest-prefix matching and LRU eviction under a budget."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentkv.embedded.engine.prefix_cache import KVBlock, PrefixCache, chain_hashes  # noqa: E402

BLOCK = 4
LAYERS, HEADS, DIM = 2, 1, 2


def make_block(fill: float = 0.0) -> KVBlock:
    shape = (LAYERS, HEADS, BLOCK, DIM)
    return KVBlock(torch.full(shape, fill), torch.full(shape, fill))


BLOCK_BYTES = make_block().nbytes


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def fill(cache: PrefixCache, ids: list[int], salt: str | None = None) -> list[bytes]:
    hashes = cache.hashes(ids, salt)
    cache.insert(hashes, lambda i: make_block(float(i)))
    return hashes


def test_only_full_blocks_are_hashed():
    """A sequence of 10 tokens with 4-token blocks has exactly two block keys."""
    assert len(chain_hashes(tokens(10), BLOCK)) == 2


def test_a_block_key_names_its_whole_prefix():
    """Two sequences that differ only in their first block get different keys for their second block too."""
    a = chain_hashes([9, 9, 9, 9] + tokens(4), BLOCK)
    b = chain_hashes([8, 8, 8, 8] + tokens(4), BLOCK)
    assert a[1] != b[1]


def test_hashes_are_stable_across_calls():
    """Keys are sha256 digests of a fixed encoding, the same on every call (and process)."""
    assert chain_hashes(tokens(8), BLOCK, "s") == chain_hashes(tokens(8), BLOCK, "s")
    assert all(len(key) == 32 for key in chain_hashes(tokens(8), BLOCK))


def test_different_salts_never_share_blocks():
    """The same tokens under different salts (or none, or the empty string) have disjoint keys."""
    keys = [set(chain_hashes(tokens(8), BLOCK, salt)) for salt in (None, "", "a", "b")]
    for i, first in enumerate(keys):
        for second in keys[i + 1 :]:
            assert not first & second


def test_match_returns_the_longest_cached_leading_run():
    """After caching 3 blocks, a longer request with the same start matches exactly those 3 blocks."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=100 * BLOCK_BYTES)
    fill(cache, tokens(12))
    blocks = cache.match(cache.hashes(tokens(12) + [77, 78, 79, 80]))
    assert [float(b.keys[0, 0, 0, 0]) for b in blocks] == [0.0, 1.0, 2.0]


def test_match_stops_at_the_first_missing_block():
    """A differing second block ends the match even when later tokens agree."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=100 * BLOCK_BYTES)
    fill(cache, tokens(12))
    assert len(cache.match(cache.hashes(tokens(4) + [99, 99, 99, 99] + tokens(4, 8)))) == 1


def test_salted_blocks_hit_only_the_same_salt():
    """Blocks cached under one salt are found under that salt and not under another."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=100 * BLOCK_BYTES)
    fill(cache, tokens(8), salt="tenant-a")
    assert len(cache.match(cache.hashes(tokens(8), "tenant-a"))) == 2
    assert cache.match(cache.hashes(tokens(8), "tenant-b")) == []
    assert cache.match(cache.hashes(tokens(8))) == []


def test_insert_builds_only_missing_blocks():
    """Inserting a chain whose head is cached builds only the new tail blocks."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=100 * BLOCK_BYTES)
    fill(cache, tokens(8))
    built: list[int] = []
    cache.insert(cache.hashes(tokens(16)), lambda i: built.append(i) or make_block())
    assert built == [2, 3]


def test_bytes_used_tracks_blocks():
    """bytes_used is the sum of the cached blocks' key and value bytes."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=100 * BLOCK_BYTES)
    fill(cache, tokens(12))
    assert cache.bytes_used == 3 * BLOCK_BYTES and len(cache) == 3


def test_eviction_keeps_memory_under_the_budget():
    """However much is inserted, bytes_used never exceeds the budget."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=5 * BLOCK_BYTES)
    for start in range(0, 400, 8):
        fill(cache, tokens(8, start))
        assert cache.bytes_used <= cache.budget_bytes
    assert len(cache) == 5 and cache.evictions > 0


def test_eviction_is_least_recently_used():
    """A chain that was matched recently survives; the one untouched longest is evicted."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=4 * BLOCK_BYTES)
    first, second = fill(cache, tokens(8)), fill(cache, tokens(8, 100))
    cache.match(first)
    fill(cache, tokens(8, 200))
    assert all(key in cache for key in first)
    assert not any(key in cache for key in second)


def test_a_chain_loses_its_tail_before_its_head():
    """Under pressure the last blocks of a prefix are evicted first, so its head stays reusable."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=4 * BLOCK_BYTES)
    chain = fill(cache, tokens(16))
    fill(cache, tokens(4, 100))
    assert [key in cache for key in chain] == [True, True, True, False]


def test_a_chain_larger_than_the_budget_caches_its_head():
    """Inserting more than fits caches the leading blocks that fit and reports how many."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=3 * BLOCK_BYTES)
    covered = cache.insert(cache.hashes(tokens(20)), lambda i: make_block())
    assert covered == 3 and cache.bytes_used == 3 * BLOCK_BYTES


def test_resize_evicts_down_to_the_new_budget():
    """Shrinking the budget evicts until the cache fits; a zero budget caches nothing."""
    cache = PrefixCache(block_size=BLOCK, budget_bytes=10 * BLOCK_BYTES)
    fill(cache, tokens(32))
    cache.resize(2 * BLOCK_BYTES)
    assert cache.bytes_used == 2 * BLOCK_BYTES
    cache.resize(0)
    assert len(cache) == 0 and fill(cache, tokens(8)) and len(cache) == 0
