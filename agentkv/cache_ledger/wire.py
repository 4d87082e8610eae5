"""vLLM's KV-event wire, read (pure: frames and bytes in, numbers and events out; no sockets).

As ``vllm/distributed/kv_events.py`` (0.32) sends it:

- a published message is three frames, ``(topic, seq, payload)``, ``seq`` 8 bytes big-endian from 0;
- a replay request is one frame after the DEALER's empty delimiter: the start ``seq``, 8 bytes big-endian. The
  ROUTER answers ``(identity, b"", topic, seq, payload)`` per buffered batch from there on, then the end marker
  ``(identity, b"", b"", seq -1 as 8 signed bytes, b"")``; a DEALER reads each as four frames,
  ``(b"", topic, seq, payload)``. The embedded server up to now answered without the topic, ``(b"", seq,
  payload)``: both are read;
- a payload is msgpack of ``EventBatch(ts, events, data_parallel_rank)`` declared ``array_like`` with
  ``omit_defaults``: an outer array ``[ts, events]`` or ``[ts, events, rank]``; each event a map tagged
  ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with the fields that differ from their
  defaults (``extra_keys``, ``group_idx``, ``locality``, ... may be absent). A map-shaped batch
  ``{ts, events, data_parallel_rank}`` is read too. Events are read by field name
  (:func:`agentkv.cache_ledger.tree.event_fields`), so a field added later or left out is no error.

Usage::

    seq, payload = published(frames)
    reply = replayed(frames)            # None when it is not a reply; reply.end for the end marker
    batch = decode_batch(decoder, payload)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

__all__ = ["END_SEQ", "Batch", "ReplayedBatch", "decode_batch", "published", "replay_request", "replayed"]

END_SEQ = -1


@dataclass(frozen=True)
class ReplayedBatch:
    """One frame set from the replay endpoint: a buffered batch's ``seq`` and payload, or the end marker."""

    seq: int
    payload: bytes

    @property
    def end(self) -> bool:
        """The end marker: every buffered batch from the requested start has been sent."""
        return self.seq == END_SEQ


@dataclass(frozen=True)
class Batch:
    """One decoded ``EventBatch``: the publisher's ``time.time()``, its events, and its data-parallel rank."""

    ts: float
    events: list[Any]
    rank: int | None = None


def replay_request(start: int) -> tuple[bytes, bytes]:
    """The frames a DEALER sends to ask for every buffered batch from ``start`` on (delimiter, start)."""
    return b"", start.to_bytes(8, "big")


def published(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a published message ``(topic, seq, payload)``; None for any other shape."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]


def replayed(frames: Sequence[bytes]) -> ReplayedBatch | None:
    """A replay reply as a DEALER reads it: ``(b"", topic, seq, payload)`` (vLLM) or ``(b"", seq, payload)`` (the
    embedded server so far), the end marker alike; None for any other shape."""
    if not frames or frames[0] != b"":
        return None
    body = frames[1:]
    if len(body) == 3:
        body = body[1:]  # the topic
    if len(body) != 2 or len(body[0]) != 8:
        return None
    return ReplayedBatch(int.from_bytes(body[0], "big", signed=True), body[1])


def decode_batch(decoder: msgspec.msgpack.Decoder[Any], payload: bytes) -> Batch:
    """The batch in one payload; ValueError (quoting nothing of it) when it is not an ``EventBatch``."""
    try:
        raw: Any = decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError("a KV-event payload is not msgpack") from exc
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, (list, tuple)) or len(raw) not in (2, 3):
        raise ValueError("a KV-event payload is not an EventBatch [ts, events, rank]")
    ts, events, rank = (*raw, None)[:3]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not isinstance(events, (list, tuple)):
        raise ValueError("a KV-event batch lacks its timestamp or its events")
    return Batch(float(ts), list(events), rank if isinstance(rank, int) and not isinstance(rank, bool) else None)
