"""The ledger's hit rate against the server's own: vLLM's prefix-cache counters over one window, pure.

vLLM counts prefix-cache queries and hits in tokens (``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``; before v0.10 ``vllm:gpu_prefix_cache_queries_total`` and ``..._hits_total``),
one sample per engine. The server's counters cover every client, so a comparison uses the difference between two
scrapes, set beside what the ledger recorded between the same two scrapes.

Usage::

    before = server_counters(metrics_text)          # at the window's start
    ...                                             # traffic; the ledger records what it sees
    check = compare("big", before, server_counters(later_text), ledger_before, ledger_after, window_s=60.0)
    check.gap, check.unrecorded_queries
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["HitCounters", "HitRateCheck", "compare", "server_counters"]

_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


@dataclass(frozen=True)
class HitCounters:
    """Prefix-cache tokens queried and tokens found cached, as counted so far; ``created``: when the server's
    counters started (vLLM's ``_created`` series; None where it exposes none), not part of equality."""

    queries: int = 0
    hits: int = 0
    created: float | None = field(default=None, compare=False)

    def __sub__(self, other: HitCounters) -> HitCounters:
        return HitCounters(self.queries - other.queries, self.hits - other.hits)

    @property
    def hit_rate(self) -> float | None:
        """hits ÷ queries; None before any query."""
        return self.hits / self.queries if self.queries else None


@dataclass(frozen=True)
class HitRateCheck:
    """One window: the server's counted tokens beside the ledger's recorded ones, and how far apart they are.

    ``unrecorded_queries``: tokens the server was queried for that the ledger never recorded (another client,
    or a request that was not recorded); ``gap``: server hit rate − ledger hit rate (None when either is
    undefined). A server restart inside the window shows as ``reset`` (its counters went down, or their
    ``_created`` time changed); ``server`` then counts from the restart.
    """

    backend: str
    window_s: float
    server: HitCounters
    ledger: HitCounters
    reset: bool = False

    @property
    def unrecorded_queries(self) -> int:
        return self.server.queries - self.ledger.queries

    @property
    def gap(self) -> float | None:
        server, ledger = self.server.hit_rate, self.ledger.hit_rate
        return None if server is None or ledger is None else server - ledger

    @property
    def agrees(self) -> bool:
        """The server counted exactly the tokens the ledger recorded, queried and hit."""
        return not self.reset and self.server == self.ledger


def server_counters(text: str) -> HitCounters:
    """The prefix-cache counters in a Prometheus text exposition, summed over engines (and model names).

    Raises ValueError when neither vLLM's current nor its former counter names are present, or when one of their
    samples is not a finite number (the message quotes nothing the server sent).
    """
    samples = _samples(text)
    queries = next((name for name in _QUERIES if name in samples), None)
    hits = next((name for name in _HITS if name in samples), None)
    if queries is None or hits is None:
        raise ValueError("no vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total in the metrics")
    created = [_number(raw) for raw in samples.get(queries.removesuffix("_total") + "_created", [])]
    return HitCounters(int(sum(map(_number, samples[queries]))), int(sum(map(_number, samples[hits]))),
                       min(created) if created else None)  # a series added later is not a restart


def _samples(text: str) -> dict[str, list[str]]:
    """Each ``vllm:*prefix_cache_*`` series' raw sample values, one per label set (``# HELP``/``# TYPE`` skipped)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "prefix_cache_" in line:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            fields = (line.rpartition("}")[2] if "{" in line else line[len(name):]).split()
            out.setdefault(name, []).append(fields[0] if fields else "")  # value, then an optional timestamp
    return out


def _number(raw: str) -> float:
    """A sample's value; ValueError (quoting nothing) unless it is a finite number."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError("a prefix-cache counter sample in the metrics is not a finite number")
    return value


def compare(backend: str, server_before: HitCounters, server_after: HitCounters, ledger_before: HitCounters,
            ledger_after: HitCounters, *, window_s: float) -> HitRateCheck:
    """The window between two scrapes: the server's deltas beside the ledger's."""
    server = server_after - server_before
    restarted = None not in (server_before.created, server_after.created) and server_before.created != server_after.created
    reset = restarted or server.queries < 0 or server.hits < 0
    return HitRateCheck(backend, window_s, server_after if reset else server, ledger_after - ledger_before, reset)
