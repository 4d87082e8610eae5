"""vLLM's KV cache events, published by the embedded server: same config, sockets, framing and encoding.

Mirrors ``vllm/distributed/kv_events.py`` so that a subscriber written for vLLM decodes ours unchanged:

- config: vLLM's ``--kv-events-config`` JSON (:class:`KVEventsConfig`: ``enable_kv_cache_events``,
  ``publisher`` ``"zmq"``/``"null"``, ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
  ``max_queue_size``, ``topic``);
- sockets: a PUB socket (bound when the endpoint has ``*``, ``::``, ``ipc://`` or ``inproc://``, else
  connected, as vLLM decides) and, with ``replay_endpoint``, a bound ROUTER that answers an 8-byte big-endian
  start sequence with every buffered batch from there on, then an end marker;
- framing: published multipart ``(topic, seq as 8-byte big-endian, payload)``, ``seq`` counting from 0. A replay
  reply is ``(identity, b"", topic, seq, payload)`` and the end marker ``(identity, b"", b"", seq -1, b"")``, so
  a DEALER reads 4 frames each (empty delimiter, topic, seq, payload) and a REQ 3, as from vLLM 0.32;
- encoding: msgspec msgpack of :class:`KVEventBatch`: the batch an outer array ``[ts, events, dp_rank]``
  (``array_like``), each event a map tagged ``"type"`` (vLLM 0.32's ``kv_events.py``; fields at their default
  are left out), block hashes as vLLM's default integer form (the digest's low 64 bits), ``medium`` ``"GPU"``, group 0
  ``"full_attention"``, and ``extra_keys`` one entry per block: ``(cache_salt,)`` on a chain's first block
  when the request has a salt, ``None`` otherwise (vLLM's ``generate_block_hash_extra_keys``).

Usage::

    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    publisher = make_publisher(config)
    engine.prefix_cache.on_events = publisher.publish_cache_events
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from itertools import count
from typing import Any, Mapping, Sequence

import msgspec
import zmq

from agentkv.errors import ConfigurationError
from agentkv.events import emit
from agentkv.embedded.engine.prefix_cache import CacheEvent

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVEventBatch", "KVEventsConfig",
    "NullEventPublisher", "ZmqEventPublisher", "external_hash", "make_publisher", "to_vllm_events",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: same fields, same defaults (``publisher`` follows ``enable_kv_cache_events``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ConfigurationError(f"kv-events publisher must be 'zmq' or 'null', got {self.publisher!r}")

    @classmethod
    def from_json(cls, value: str | Mapping[str, Any]) -> KVEventsConfig:
        """Parse ``--kv-events-config``'s JSON (or a mapping); unknown keys are refused."""
        data = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigurationError(f"unknown kv-events-config keys: {sorted(unknown)}")
        return cls(**data)


# --- the wire structs: fields, order and struct options as vllm/distributed/kv_events.py ----------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; tagged by class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(digest: bytes) -> int:
    """vLLM's integer block hash: the digest's low 64 bits, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def to_vllm_events(events: Sequence[CacheEvent], block_size: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The prefix cache's events as vLLM's structs."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in events:
        if event.kind == "cleared":
            out.append(AllBlocksCleared())
        elif event.kind == "removed":
            out.append(BlockRemoved(block_hashes=[external_hash(h) for h in event.hashes], medium=MEDIUM_GPU,
                                    group_idx=0))
        else:
            extra: list[tuple[Any, ...] | None] = [None] * len(event.hashes)
            if event.parent is None and event.salt:
                extra[0] = (event.salt,)
            out.append(BlockStored(
                block_hashes=[external_hash(h) for h in event.hashes],
                parent_block_hash=None if event.parent is None else external_hash(event.parent),
                token_ids=list(event.token_ids), block_size=block_size, lora_id=None, medium=MEDIUM_GPU,
                lora_name=None, extra_keys=extra, group_idx=0, kv_cache_spec_kind="full_attention"))
    return out


# --- publishers -------------------------------------------------------------------------------------


class NullEventPublisher:
    """Publishes nothing (``publisher: "null"`` or events disabled)."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def publish(self, batch: EventBatch) -> None:
        return None

    def publish_cache_events(self, events: list[CacheEvent]) -> None:
        return None

    def shutdown(self) -> None:
        return None


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a stable (wildcard or local-transport) address, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """vLLM's PUB/ROUTER publisher: a queue drained by one thread, with a replay buffer of past batches."""

    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, *, block_size: int = 16, data_parallel_rank: int = 0, endpoint: str = "tcp://*:5557",
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "") -> None:
        self.block_size = block_size
        self._rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._seq = count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="agentkv-kv-events", daemon=True)
        self._thread.start()
        emit("local.kv_events.started", endpoint=endpoint, replay_endpoint=replay_endpoint)

    @property
    def endpoint(self) -> str:
        """Where the PUB socket listens (its resolved address when bound)."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, batch: EventBatch) -> None:
        """Queue a batch (stamped with this publisher's data-parallel rank); blocks only when the queue is full."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        self._queue.put(batch)

    def publish_cache_events(self, events: list[CacheEvent]) -> None:
        """The prefix cache's ``on_events`` hook: one batch per cache operation."""
        self.publish(KVEventBatch(ts=time.time(), events=to_vllm_events(events, self.block_size)))

    def shutdown(self) -> None:
        """Send what is queued (up to ``SHUTDOWN_TIMEOUT``), stop the thread, close the sockets."""
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        emit("local.kv_events.stopped", published=len(self._buffer))

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """Answer ``[identity, b"", start]`` with ``[identity, b"", topic, seq, payload]`` per buffered batch from
        ``start`` on, then the end marker ``[identity, b"", b"", -1, b""]``, exactly as vLLM 0.32's publisher."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            emit("local.kv_events.bad_replay_request", level="warning", frames=len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | str | Mapping[str, Any] | None, *, block_size: int = 16,
                   data_parallel_rank: int = 0) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher a config asks for (vLLM's ``EventPublisherFactory.create``)."""
    if config is not None and not isinstance(config, KVEventsConfig):
        config = KVEventsConfig.from_json(config)
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher(block_size)
    options = asdict(config)
    del options["enable_kv_cache_events"], options["publisher"]
    return ZmqEventPublisher(block_size=block_size, data_parallel_rank=data_parallel_rank, **options)
