"""What the cache ledger costs: memory per 1M resident tokens, and the event rate it keeps up with.

Side by side in one run, on vLLM-shaped traffic (block size 16, each batch one request's chain of new blocks,
with evictions once the pool is full):

- memory: tracemalloc of a ``BlockTree`` holding 1M resident tokens (62,500 blocks), per block and per 1M tokens;
- apply rate: decode + apply in one thread, no sockets (the ceiling);
- end to end: a ``ZmqEventPublisher`` flooding a ``CacheLedger`` over tcp on 127.0.0.1, timed from the first
  publish until the ledger has applied the last batch (``unrepaired`` says whether anything was lost), and its
  headroom over the block-store rate of a server prefilling 100K tokens/s.

    python benchmarks/ledger.py [--tokens 1000000] [--batches 4000]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

import msgspec

from agentkv.backends import Backend
from agentkv.cache_ledger import BlockTree, CacheLedger
from agentkv.embedded.server.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

BLOCK = 16


def traffic(batches: int, blocks_per_batch: int, pool_blocks: int, seed: int = 0) -> list[KVEventBatch]:
    """Chains of ``blocks_per_batch`` new blocks under a handful of salts; past ``pool_blocks``, evict the oldest."""
    rng = random.Random(seed)
    out, resident, next_hash = [], [], 1
    for step in range(batches):
        hashes = list(range(next_hash, next_hash + blocks_per_batch))
        next_hash += blocks_per_batch
        tokens = [rng.randrange(150_000) for _ in range(blocks_per_batch * BLOCK)]
        salt = f"{rng.randrange(8):064x}"
        events: list[BlockStored | BlockRemoved] = []
        resident += hashes
        if len(resident) > pool_blocks:
            gone, resident = resident[: len(resident) - pool_blocks], resident[len(resident) - pool_blocks:]
            events.append(BlockRemoved(block_hashes=gone, medium="GPU", group_idx=0))
        events.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK,
                                  lora_id=None, medium="GPU", lora_name=None,
                                  extra_keys=[(salt,)] + [None] * (blocks_per_batch - 1), group_idx=0,
                                  kv_cache_spec_kind="full_attention"))
        out.append(KVEventBatch(ts=float(step), events=events, data_parallel_rank=0))  # type: ignore[arg-type]
    return out


def memory(tokens: int) -> tuple[int, int]:
    """(bytes, blocks) of a tree holding ``tokens`` resident tokens."""
    blocks = tokens // BLOCK
    payloads = [msgspec.msgpack.encode(b) for b in traffic(blocks // 64, 64, blocks + 1)]
    decoder = msgspec.msgpack.Decoder()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    tree = BlockTree(max_blocks=blocks * 2)
    for payload in payloads:  # decoded here and dropped: only what the tree keeps is counted
        batch = decoder.decode(payload)
        tree.apply(batch[1], now=batch[0])
    del batch
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return used, len(tree)


def apply_rate(payloads: list[bytes]) -> float:
    """Events per second decoded and applied in one thread."""
    decoder, tree = msgspec.msgpack.Decoder(), BlockTree()
    events = 0
    start = time.perf_counter()
    for payload in payloads:
        batch = decoder.decode(payload)
        tree.apply(batch[1], now=batch[0])
        events += len(batch[1])
    return events / (time.perf_counter() - start)


def end_to_end(batches: list[KVEventBatch]) -> tuple[float, float, int, int]:
    """(queueing events/s, ledger events/s first publish to last applied, unrepaired, replayed) over loopback."""
    publisher = ZmqEventPublisher(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                  buffer_steps=len(batches) + 1)
    backend = Backend("hosted_vllm/bench", name="bench", kv_events=publisher.endpoint,
                      kv_events_replay=publisher.replay_endpoint)
    events = sum(len(b.events) for b in batches)
    with CacheLedger([backend]) as ledger:
        time.sleep(0.3)
        start = time.perf_counter()
        for batch in batches:
            publisher.publish(batch)
        published = time.perf_counter()
        while ledger.last_seq(backend) < len(batches) - 1:
            time.sleep(0.001)
        done = time.perf_counter()
        (stats,) = ledger.stats()
    publisher.shutdown()
    return events / (published - start), events / (done - start), stats.unrepaired, stats.replayed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=4000)
    args = parser.parse_args()

    used, blocks = memory(args.tokens)
    print(f"memory: {blocks} blocks ({blocks * BLOCK} tokens) hold {used / 2**20:.1f} MiB "
          f"= {used / blocks:.0f} B/block = {used / 2**20 * 1_000_000 / (blocks * BLOCK):.1f} MiB per 1M tokens")

    batches = traffic(args.batches, 8, 20_000, seed=1)
    payloads = [msgspec.msgpack.encode(b) for b in batches]
    events = sum(len(b.events) for b in batches)
    rate = apply_rate(payloads)
    _, ledger, unrepaired, replayed = end_to_end(batches)
    print(f"traffic: {len(batches)} batches, {events} events, 8 blocks (128 tokens) stored per batch")
    per_event = len(batches) * 8 / events  # blocks stored per event (the rest are removals)
    print(f"apply only (decode+apply, 1 thread): {rate:,.0f} events/s = {rate * per_event:,.0f} blocks stored/s")
    blocks_s = ledger * per_event
    print(f"end to end over ZMQ (publisher flooding, same 2 cores): ledger {ledger:,.0f} events/s "
          f"= {blocks_s:,.0f} blocks stored/s, replayed {replayed}, unrepaired {unrepaired}")
    print(f"headroom: a server prefilling 100K tokens/s stores {100_000 // BLOCK:,} blocks/s; "
          f"ledger/that = {blocks_s / (100_000 / BLOCK):.1f}x")


if __name__ == "__main__":
    main()
