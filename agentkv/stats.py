"""Per-session counters and the per-turn token ledger."""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

COUNTERS = (
    "requests_total", "proactive_routes", "clamps", "reactive_clamps", "reactive_escalations",
    "reactive_fallbacks", "escalations", "overflow_errors", "slow_overflow_refusals",
    "warm_fired", "warm_skipped_cooldown", "warm_skipped_disabled", "warm_skipped_unknown_model",
    "warm_skipped_saturated", "warm_skipped_state_unavailable", "warm_failed", "warm_completed", "escalations_after_warm",
    "cached_tokens_total", "cached_tokens_on_escalation", "mapped_tokens", "handoff_mapped", "handoff_fallbacks",
    "catalog_refusals", "warm_prefix_broken", "observed_requests", "failovers",
    "cached_tokens_unknown",
    "warm_skipped_resident", "warm_rewarm_evicted", "warm_top_up", "warm_skipped_break_even",
    "ledger_predictions", "ledger_predictions_exact", "ledger_predicted_tokens", "ledger_reported_tokens",
    "ledger_predictions_unknown", "server_clamps", "affinity_misses", "replica_failovers",
    "warm_skipped_below_cache_minimum", "warm_skipped_cost",
    "cache_write_tokens", "cache_read_tokens", "warm_cache_write_tokens", "escalation_cache_read_tokens",
)
DOLLARS = ("cost_usd", "warm_cost_usd", "cache_saved_usd", "escalation_saved_usd")
"""Money a Session's hosted requests cost and their cache reads saved, priced from litellm's cost map
(:mod:`agentkv.providers.prices`): every answer's cost, the warms' share of it, and what reads saved (escalations' share)."""


@dataclass(frozen=True)
class LedgerEntry:
    """One request: its tokens, the tool schemas' share, the count source, the route, cached tokens.

    ``exact`` says which count the decisions used: the exact one (the template, or the server asked
    because a decision depended on it) or the estimate (``count_source`` "tiktoken" or "chars", whose
    interval could not change any decision); :attr:`count_kind` says it in words.
    """

    turn: int
    input_tokens: int
    tool_tokens: int
    tools_share: float
    count_source: str
    exact: bool
    backend: str
    reason: str
    warm: str
    cached_tokens: int | None = None

    @property
    def count_kind(self) -> str:
        """"exact" or "estimate": which count this turn's decisions used."""
        return "exact" if self.exact else "estimate"


class SessionStats:
    """Thread-safe counters: flat named counters plus requests per backend."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._per_backend: Counter[str] = Counter()
        self._per_replica: Counter[str] = Counter()
        self._usd: dict[str, float] = {name: 0.0 for name in DOLLARS}

    def add_usd(self, name: str, amount: float) -> None:
        """Add ``amount`` dollars to the money counter ``name`` (one of :data:`DOLLARS`); money only ever adds up:
        a negative or non-finite amount adds nothing."""
        if not 0.0 <= amount < math.inf:
            return
        with self._lock:
            self._usd[name] += amount

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name``; counters only ever grow: a negative amount adds nothing."""
        with self._lock:
            self._counts[name] += max(amount, 0)

    def request(self, backend: str, replica: str | None = None) -> None:
        """One answered request to ``backend`` (and to ``replica``, a pool's URL, when it is one)."""
        with self._lock:
            self._per_backend[backend] += 1
            if replica is not None:
                self._per_replica[replica] += 1
            self._counts["requests_total"] += 1

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, Any]:
        """A plain dict: every counter, the :data:`DOLLARS`, ``requests`` per backend name and ``replica_requests``
        per pool replica."""
        with self._lock:
            return {**dict(self._counts), **{k: round(v, 9) for k, v in self._usd.items()},
                    "requests": dict(self._per_backend),
                    "replica_requests": dict(self._per_replica)}
