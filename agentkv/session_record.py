"""What a Session records about its requests: counters by route, the per-turn ledger, escalations.

Recording never changes what is sent; it runs after a response (or when a stream reports its usage).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from agentkv.events import emit
from agentkv.payload import Payload, TokenCount
from agentkv.prefix import PrefixReport
from agentkv.routing import RouteDecision
from agentkv.session_parts import Attempt, StreamWatcher, response_cached_tokens
from agentkv.stats import LedgerEntry, SessionStats

_REASON_COUNTERS = {"proactive": "proactive_routes", "clamped": "clamps", "reactive_clamp": "reactive_clamps",
                    "reactive_escalate": "reactive_escalations"}

Report = Callable[[Payload, Payload, str], PrefixReport]


class Recorder:
    """One Session's stats and ledger. ``warmed`` says what warm-ahead last warmed; ``report`` compares
    two payloads' rendered prefixes with a backend's tokenizer (for the broken-warm warning)."""

    def __init__(self, stats: SessionStats, warmed: Callable[[], Payload | None], report: Report,
                 session_id: str) -> None:
        self.stats = stats
        self.ledger: list[LedgerEntry] = []
        self._warmed, self._report, self._session_id = warmed, report, session_id
        self._previous_role: str | None = None

    def is_escalation(self, decision: RouteDecision) -> bool:
        """The move to slow: a size-routed slow request after fast (or first) ones."""
        return decision.role == "slow" and decision.reason in ("proactive", "reactive_escalate") \
            and self._previous_role != "slow"

    def finish(self, attempt: Attempt, response: Any) -> Any:
        """Count the answered request, add its ledger row, and record its cached tokens (now, or when a
        stream reports usage)."""
        decision = attempt.decision
        self.stats.request(decision.backend)
        if decision.reason in _REASON_COUNTERS:
            self.stats.add(_REASON_COUNTERS[decision.reason])
        entry = self._append(attempt.count, decision.backend, decision.reason, attempt.warm)
        escalation = self.is_escalation(decision)
        self._previous_role = decision.role
        if attempt.kwargs.get("stream"):
            return StreamWatcher(response, lambda cached: self._cached(attempt, entry, cached, escalation))
        self._cached(attempt, entry, response_cached_tokens(response), escalation)
        return response

    def observed(self, count: TokenCount, backend: str, warm: str) -> LedgerEntry:
        """The ledger row of a request sent outside the Session."""
        self.stats.add("observed_requests")
        return self._append(count, backend, "observed", warm)

    def record_usage(self, turn: int, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to a ledger turn."""
        index = turn - 1
        if not 0 <= index < len(self.ledger):
            raise ValueError(f"no ledger turn {turn}; the ledger has {len(self.ledger)} turns")
        self.ledger[index] = replace(self.ledger[index], cached_tokens=cached_tokens)
        self.stats.add("cached_tokens_total", cached_tokens or 0)

    def _append(self, count: TokenCount, backend: str, reason: str, warm: str) -> LedgerEntry:
        entry = LedgerEntry(len(self.ledger) + 1, count.total, count.tools, round(count.tools_share, 4), count.source,
                            count.exact, backend, reason, warm)
        self.ledger.append(entry)
        return entry

    def _cached(self, attempt: Attempt, entry: LedgerEntry, cached: int | None, escalation: bool) -> None:
        self.stats.add("cached_tokens_total", cached or 0)
        index = entry.turn - 1
        if index < len(self.ledger) and self.ledger[index] is entry:
            self.ledger[index] = replace(entry, cached_tokens=cached)
        if escalation:
            self._escalated(attempt, cached)

    def _escalated(self, attempt: Attempt, cached: int | None) -> None:
        self.stats.add("escalations")
        self.stats.add("cached_tokens_on_escalation", cached or 0)
        warmed = self._warmed()
        if warmed is None:
            return
        self.stats.add("escalations_after_warm")
        report = self._report(warmed, attempt.payload, attempt.backend.label)
        if not report.intact:
            self.stats.add("warm_prefix_broken")
            emit("warm_prefix_broken", level="warning", reason=report.reason, reusable_tokens=report.reusable_tokens,
                 warmed_tokens=report.previous_tokens, session=self._session_id)
