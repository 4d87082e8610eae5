"""One background thread per KV-events endpoint: ZMQ SUB, sequence-gap detection, catch-up through replay.

Speaks vLLM's wire (``vllm/distributed/kv_events.py``): frames ``(topic, seq, payload)``; a replay request is
the start sequence as 8 bytes big-endian, answered by ``(seq, payload)`` frames and an end marker (``seq`` -1,
empty payload). On start the subscriber first replays what the buffer holds (the history it missed); a gap
later on is repaired the same way; what the buffer no longer holds is counted in ``unrepaired``. A sequence
number that goes backwards with a newer timestamp (the server restarted) resets the tree; one with an older
timestamp is a batch already applied through replay.

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
from agentkv.ledger.tree import BlockTree

__all__ = ["EndpointSubscriber"]

_END = -1


class EndpointSubscriber:
    """Keeps one :class:`BlockTree` in step with one publisher."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None, tree: BlockTree,
                 lock: threading.Lock, *, topic: str = "", replay_timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.tree = tree
        self.lock = lock
        self.topic = topic
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
        self._decoder = msgspec.msgpack.Decoder()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agentkv-ledger-{name}", daemon=True)

    def start(self) -> EndpointSubscriber:
        self._thread.start()
        self._ready.wait(5.0)
        return self

    @property
    def running(self) -> bool:
        """The thread is started and not stopped (the tree follows the publisher)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    # --- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
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

    def _replay_socket(self) -> zmq.Socket[bytes] | None:
        if self.replay_endpoint is None:
            return None
        # DEALER: REQ's framing (b"", request) without REQ's lock-step, so a lost reply cannot wedge the socket.
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        return sock

    def handle(self, frames: list[bytes], replay: zmq.Socket[bytes] | None) -> None:
        """One published message: catch up on any gap first, then apply it."""
        if len(frames) != 3:
            self.errors += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        batch = self._decode(payload)
        if batch is None:
            return
        if seq <= self.last_seq:
            if batch[0] <= self.last_ts:
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
        """Request ``start ..`` and apply, in order, each batch before ``stop`` (all, when None)."""
        replay.send_multipart((b"", start.to_bytes(8, "big")))
        while replay.poll(int(self.replay_timeout_s * 1000)):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                continue
            got = int.from_bytes(frames[1], "big", signed=True)
            if got == _END or not frames[2]:
                return
            batch = self._decode(frames[2])
            if batch is not None and self.last_seq < got and (stop is None or got < stop):
                self._skip_to(got)
                self._apply(got, batch)
                self.replayed += 1

    def _skip_to(self, seq: int) -> None:
        """Give up on ``last_seq + 1 .. seq - 1``: the replay buffer had dropped them (or there is no replay)."""
        missed = seq - 1 - self.last_seq
        if missed > 0:
            self.unrepaired += missed
            emit("ledger.gap_unrepaired", level="warning", backend=self.name, missed=missed)
            self.last_seq = seq - 1

    def _decode(self, payload: bytes) -> tuple[float, list[Any]] | None:
        """``(ts, events)`` of one batch (array-shaped as vLLM sends it, or a map); None, counted, if unreadable."""
        try:
            batch: Any = self._decoder.decode(payload)
            if isinstance(batch, dict):
                batch = [batch.get("ts"), batch.get("events")]
            return float(batch[0]), list(batch[1])
        except Exception:  # noqa: BLE001 - a payload we cannot read is counted, never fatal to the thread
            self.errors += 1
            return None

    def _apply(self, seq: int, batch: tuple[float, list[Any]]) -> None:
        ts, events = batch
        with self.lock:
            self.tree.apply(events, now=ts)
        self.last_seq = seq
        self.last_ts = ts
        self.batches += 1
        self.events += len(events)
