"""One background thread per KV-events endpoint: ZMQ SUB, sequence-gap detection, catch-up through replay.

Speaks vLLM's wire (``vllm/distributed/kv_events.py``, read by :mod:`agentkv.cache_ledger.wire`): published frames
``(topic, seq, payload)``; a replay request is the start sequence as 8 bytes big-endian, answered by ``(b"", topic,
seq, payload)`` frame sets and an end marker (``seq`` -1, empty payload) that ends the wait at once. The SUB
socket connects to the publisher, or binds where the publisher connects (:mod:`agentkv.cache_ledger.sources`).
On start the subscriber first replays what the buffer holds (the history it missed); a gap later on is repaired
the same way; what the buffer no longer holds is counted in ``unrepaired``, and a replay that never reached its
end marker in ``replay_timeouts``. A sequence number that goes backwards with a newer timestamp (the server
restarted) resets the tree; one with an older timestamp is a batch already applied through replay.

The thread applies each batch under ``lock`` in one short critical section; readers take the same lock for a
dictionary walk, so no request ever waits on the network.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from agentkv.events import emit
from agentkv.cache_ledger.tree import BlockTree
from agentkv.cache_ledger.wire import Batch, decode_batch, published, replay_request, replayed

__all__ = ["EndpointSubscriber"]


class EndpointSubscriber:
    """Keeps one :class:`BlockTree` in step with one publisher.

    ``bind``: the publisher connects to ``endpoint`` (vLLM with a non-wildcard endpoint), so the SUB socket binds
    it; otherwise it connects. ``topic``: the prefix subscribed to (``""``: every topic)."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None, tree: BlockTree,
                 lock: threading.Lock, *, topic: str = "", bind: bool = False, replay_timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.tree = tree
        self.lock = lock
        self.topic = topic
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.last_seq = -1
        self.last_ts = float("-inf")
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.replayed = 0
        self.unrepaired = 0
        self.errors = 0
        self.replays = 0  # replay requests sent
        self.replay_timeouts = 0  # of those, the ones whose end marker never came within replay_timeout_s
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agentkv-ledger-{name}", daemon=True)

    def start(self, *, wait_s: float = 60.0) -> EndpointSubscriber:
        """Start the thread and wait (up to ``wait_s``) for its start-up replay to be applied."""
        self._thread.start()
        self.wait_ready(wait_s)
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the start-up replay is applied (or failed); True when it is. The replay is bounded: batches
        stream to the end marker, each wait for the next bounded by ``replay_timeout_s``."""
        return self._ready.wait(timeout_s)

    @property
    def running(self) -> bool:
        """The thread is started and not stopped (the tree follows the publisher)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    # --- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            sub = self._sub_socket()
        except zmq.ZMQError:
            self.errors += 1
            emit("ledger.subscribe_failed", level="exception", backend=self.name, bind=self.bind)
            self._ready.set()
            return
        replay = self._replay_socket()
        try:
            self.sync(replay)
        except Exception:  # noqa: BLE001 - a failed start-up sync leaves the gap logic to repair
            self.errors += 1
            emit("ledger.sync_failed", level="exception", backend=self.name)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(50):
                    try:
                        self.handle(sub.recv_multipart(), replay)
                    except Exception:  # noqa: BLE001 - the thread outlives any one bad message
                        self.errors += 1
                        emit("ledger.message_failed", level="exception", backend=self.name)
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _sub_socket(self) -> zmq.Socket[bytes]:
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        try:
            (sub.bind if self.bind else sub.connect)(self.endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        return sub

    def _replay_socket(self) -> zmq.Socket[bytes] | None:
        if self.replay_endpoint is None:
            return None
        # DEALER: REQ's framing (b"", request) without REQ's lock-step, so a lost reply cannot wedge the socket.
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        return sock

    def handle(self, frames: list[bytes], replay: zmq.Socket[bytes] | None) -> None:
        """One published message: catch up on any gap first, then apply it."""
        message = published(frames)
        if message is None:
            self.errors += 1
            return
        seq, payload = message
        batch = self._decode(payload)
        if batch is None:
            return
        if seq <= self.last_seq:
            if batch.ts <= self.last_ts:
                return  # already applied: it came through a replay first
            # an older sequence number with a newer clock: the publisher restarted, and what we knew went with it
            emit("ledger.publisher_restarted", backend=self.name, seq=seq, last_seq=self.last_seq)
            with self.lock:
                self.tree.clear()
            self.last_seq = -1
        if seq > self.last_seq + 1:
            self._catch_up(seq, replay)
        if seq > self.last_seq:
            self._apply(seq, batch)

    def sync(self, replay: zmq.Socket[bytes] | None) -> None:
        """Apply everything the replay buffer still holds past ``last_seq`` (a late subscriber's missed history)."""
        if replay is not None:
            self._replay(self.last_seq + 1, None, replay)

    def _catch_up(self, seq: int, replay: zmq.Socket[bytes] | None) -> None:
        """Fetch ``last_seq + 1 .. seq - 1`` from the replay endpoint; count what it could not give."""
        self.gaps += 1
        start = self.last_seq + 1
        unrepaired = self.unrepaired
        if replay is not None:
            self._replay(start, seq, replay)
        self._skip_to(seq)
        if self.unrepaired == unrepaired:
            emit("ledger.gap_repaired", backend=self.name, start=start, end=seq - 1)

    def _replay(self, start: int, stop: int | None, replay: zmq.Socket[bytes]) -> None:
        """Request ``start ..`` and apply, in order, each batch before ``stop`` (all, when None), until the end marker."""
        while replay.poll(0):  # a reply left over from a request that timed out would end this one early
            replay.recv_multipart()
        replay.send_multipart(replay_request(start))
        self.replays += 1
        while replay.poll(int(self.replay_timeout_s * 1000)):
            reply = replayed(replay.recv_multipart())
            if reply is None:
                self.errors += 1
                continue
            if reply.end:
                return
            batch = self._decode(reply.payload)
            if batch is not None and self.last_seq < reply.seq and (stop is None or reply.seq < stop):
                self._skip_to(reply.seq)
                self._apply(reply.seq, batch)
                self.replayed += 1
        self.replay_timeouts += 1
        emit("ledger.replay_timed_out", level="warning", backend=self.name, start=start,
             timeout_s=self.replay_timeout_s)

    def _skip_to(self, seq: int) -> None:
        """Give up on ``last_seq + 1 .. seq - 1``: the replay buffer had dropped them (or there is no replay)."""
        missed = seq - 1 - self.last_seq
        if missed > 0:
            self.unrepaired += missed
            emit("ledger.gap_unrepaired", level="warning", backend=self.name, missed=missed)
            self.last_seq = seq - 1

    def _decode(self, payload: bytes) -> Batch | None:
        """The batch in ``payload``; None, counted, if unreadable (never fatal to the thread)."""
        try:
            return decode_batch(self._decoder, payload)
        except ValueError:
            self.errors += 1
            emit("ledger.payload_unreadable", level="warning", backend=self.name, size=len(payload))
            return None

    def _apply(self, seq: int, batch: Batch) -> None:
        with self.lock:
            self.tree.apply(batch.events, now=batch.ts)
        self.last_seq = seq
        self.last_ts = batch.ts
        self.batches += 1
        self.events += len(batch.events)
