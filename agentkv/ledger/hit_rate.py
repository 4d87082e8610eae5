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

from dataclasses import dataclass

__all__ = ["HitCounters", "HitRateCheck", "compare", "server_counters"]

_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


@dataclass(frozen=True)
class HitCounters:
    """Prefix-cache tokens queried and tokens found cached, as counted so far."""

    queries: int = 0
    hits: int = 0

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
    undefined). A server restart inside the window shows as ``reset`` (its counters went down).
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

    Raises ValueError when neither vLLM's current nor its former counter names are present.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "prefix_cache_" in line:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            rest = line.rsplit("}", 1)[1] if "}" in line else line.split(" ", 1)[1]
            totals[name] = totals.get(name, 0.0) + float(rest.split()[0])  # value, then an optional timestamp
    queries = next((totals[name] for name in _QUERIES if name in totals), None)
    hits = next((totals[name] for name in _HITS if name in totals), None)
    if queries is None or hits is None:
        raise ValueError("no vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total in the metrics")
    return HitCounters(int(queries), int(hits))


def compare(backend: str, server_before: HitCounters, server_after: HitCounters, ledger_before: HitCounters,
            ledger_after: HitCounters, *, window_s: float) -> HitRateCheck:
    """The window between two scrapes: the server's deltas beside the ledger's."""
    server = server_after - server_before
    reset = server.queries < 0 or server.hits < 0
    return HitRateCheck(backend, window_s, server_after if reset else server, ledger_after - ledger_before, reset)
