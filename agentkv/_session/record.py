"""What a Session records about its requests: counters by route, the per-turn ledger, escalations.

Recording never changes what is sent and does no I/O; it runs after a response (or when a stream
reports its usage). Whether an answered request was the escalation is decided by
:func:`agentkv.routing.is_escalation` from :attr:`Recorder.previous_role`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from agentkv._session.attempts import Attempt
from agentkv._session.responses import StreamWatcher, response_cached_tokens
from agentkv.routing import Role
from agentkv.stats import LedgerEntry, SessionStats
from agentkv.tokens import TokenCount

_REASON_COUNTERS = {"proactive": "proactive_routes", "clamped": "clamps", "reactive_clamp": "reactive_clamps",
                    "reactive_escalate": "reactive_escalations"}


class Recorder:
    """One Session's stats and ledger, and the role of its last answered request."""

    def __init__(self, stats: SessionStats) -> None:
        self.stats = stats
        self.ledger: list[LedgerEntry] = []
        self.previous_role: Role | None = None

    def finish(self, attempt: Attempt, response: Any, *, escalation: bool, after_warm: bool,
               on_cached: Callable[[int | None], None] | None = None) -> Any:
        """Count the answered request, add its ledger row, and record its cached tokens (now, or when a
        stream reports usage). ``escalation``: it was the move to slow; ``after_warm``: a warm preceded it;
        ``on_cached`` is also handed the cached tokens once they are known."""
        decision = attempt.decision
        self.stats.request(decision.backend)
        if decision.reason in _REASON_COUNTERS:
            self.stats.add(_REASON_COUNTERS[decision.reason])
        if escalation:
            self.stats.add("escalations")
            self.stats.add("escalations_after_warm", int(after_warm))
        entry = self._append(attempt.count, decision.backend, decision.reason, attempt.warm)
        self.previous_role = decision.role

        def cached(tokens: int | None) -> None:
            self._cached(entry, tokens, escalation)
            if on_cached is not None:
                on_cached(tokens)

        if attempt.kwargs.get("stream"):
            return StreamWatcher(response, cached)
        cached(response_cached_tokens(response))
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
        self._count_cached(cached_tokens)

    def _append(self, count: TokenCount, backend: str, reason: str, warm: str) -> LedgerEntry:
        entry = LedgerEntry(len(self.ledger) + 1, count.total, count.tools, round(count.tools_share, 4), count.source,
                            count.exact, backend, reason, warm)
        self.ledger.append(entry)
        return entry

    def _cached(self, entry: LedgerEntry, cached: int | None, escalation: bool) -> None:
        self._count_cached(cached)
        index = entry.turn - 1
        if index < len(self.ledger) and self.ledger[index] is entry:
            self.ledger[index] = replace(entry, cached_tokens=cached)
        if escalation and cached is not None:
            self.stats.add("cached_tokens_on_escalation", cached)

    def _count_cached(self, cached: int | None) -> None:
        """A response without ``prompt_tokens_details`` (vLLM without ``--enable-prompt-tokens-details``)
        is counted as unknown, never as 0 cached tokens."""
        if cached is None:
            self.stats.add("cached_tokens_unknown")
        else:
            self.stats.add("cached_tokens_total", cached)
