"""What a Session records about its requests: counters by route, the per-turn ledger, escalations, server clamps.

Recording never changes what is sent and does no I/O; it runs after a response (or when a stream
reports its usage). Whether an answered request was the escalation is decided by
:func:`agentkv.routing.is_escalation` from :attr:`Recorder.previous_role`.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Callable

from agentkv._session.attempts import Attempt
from agentkv.wire.usage import StreamWatcher, Usage, report_rejected, response_usage, token_figure
from agentkv.errors import check_positive_int
from agentkv.http.transport import redact_url
from agentkv.events import emit, enabled
from agentkv.routing import Role
from agentkv.stats import LedgerEntry, SessionStats
from agentkv.tokens import TokenCount

if TYPE_CHECKING:
    from agentkv._session.pipeline import TurnEvent

_REASON_COUNTERS = {"proactive": "proactive_routes", "clamped": "clamps", "reactive_clamp": "reactive_clamps",
                    "reactive_escalate": "reactive_escalations"}


class Recorder:
    """One Session's stats and ledger (its latest ``rows`` rows when bounded), and the role of its last answered
    request."""

    def __init__(self, stats: SessionStats, *, rows: int | None = None, session: str | None = None,
                 tenant: str | None = None, report: "Callable[[TurnEvent], None] | None" = None) -> None:
        if rows is not None:
            check_positive_int("Session", "ledger_rows", rows)
        self.stats = stats
        self._session, self._tenant = session, tenant  # what each turn's event names
        self._report = report  # where an answer's event goes once its usage is known (the Session's pipeline)
        self.ledger: list[LedgerEntry] = []
        self.previous_role: Role | None = None
        self._rows = rows
        self._dropped = 0  # rows dropped from the front (a bounded ledger): turn t is at index t - 1 - dropped

    def finish(self, attempt: Attempt, response: Any, *, escalation: bool, after_warm: bool,
               event: "TurnEvent | None" = None, pooled: bool = False) -> Any:
        """Count the answered request, add its ledger row, and record its cached tokens (now, or when a
        stream reports usage). ``escalation``: it was the move to slow; ``after_warm``: a warm preceded it;
        ``event`` (the answer's) is reported with the answer's :class:`Usage` in its data once that is known;
        ``pooled``: the backend is a pool (the request is counted per replica too)."""
        decision = attempt.decision
        self.stats.request(decision.backend, redact_url(attempt.backend.api_base or "") if pooled else None)
        if decision.reason in _REASON_COUNTERS:
            self.stats.add(_REASON_COUNTERS[decision.reason])
        if escalation:
            self.stats.add("escalations")
            self.stats.add("escalations_after_warm", int(after_warm))
        entry = self._append(attempt.count, decision.backend, decision.reason, attempt.warm)
        self.previous_role = decision.role

        def answered(usage: Usage) -> None:
            report_rejected(usage, backend=attempt.backend.label, session=self._session, tenant=self._tenant)
            self._cached(entry, usage.cached_tokens, escalation)
            if event is not None and self._report is not None:
                self._report(replace(event, data={**event.data, "usage": usage}))

        if attempt.kwargs.get("stream"):  # litellm's stream; a prepared request's sender reports its usage at its end
            return StreamWatcher(response, answered)
        answered(response_usage(response))
        return response

    def server_clamp(self, attempt: Attempt, usage: Usage, *, session: str, tenant: str | None) -> None:
        """Record that the server cut the output budget it was sent (sizes only: no prompt text)."""
        self.stats.add("server_clamps")
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        emit("server_clamp", level="warning", backend=attempt.backend.label, max_tokens=attempt.decision.max_tokens,
             completion_tokens=completion, prompt_tokens=prompt, window=attempt.decision.window,
             server_window=None if prompt is None or completion is None else prompt + completion,
             session=session, tenant=tenant)

    def observed(self, count: TokenCount, backend: str, warm: str) -> LedgerEntry:
        """The ledger row of a request sent outside the Session."""
        self.stats.add("observed_requests")
        return self._append(count, backend, "observed", warm)

    def record_usage(self, turn: int, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to a ledger turn (one that is not a believable count, see
        :func:`~agentkv.wire.usage.token_figure`, is recorded as unknown, with a ``usage_rejected`` event)."""
        index = turn - 1 - self._dropped
        if not 0 <= index < len(self.ledger):
            held = f"turns {self._dropped + 1} to {self._dropped + len(self.ledger)}" if self.ledger else "no turns"
            raise ValueError(f"no ledger turn {turn}; the ledger holds {held}")
        cached, why = token_figure(cached_tokens)
        if why is not None:
            report_rejected(Usage(rejected=(("cached_tokens", why),)), backend=self.ledger[index].backend,
                            session=self._session, tenant=self._tenant)
        self.ledger[index] = replace(self.ledger[index], cached_tokens=cached)
        self._count_cached(cached)

    def _append(self, count: TokenCount, backend: str, reason: str, warm: str) -> LedgerEntry:
        entry = LedgerEntry(self._dropped + len(self.ledger) + 1, count.total, count.tools,
                            round(count.tools_share, 4), count.source, count.exact, backend, reason, warm)
        self.ledger.append(entry)
        if self._rows is not None and len(self.ledger) > self._rows:
            del self.ledger[0]  # rows is small: the shift is cheap
            self._dropped += 1
        return entry

    def _cached(self, entry: LedgerEntry, cached: int | None, escalation: bool) -> None:
        self._count_cached(cached)
        index = entry.turn - 1 - self._dropped
        if 0 <= index < len(self.ledger) and self.ledger[index] is entry:
            self.ledger[index] = replace(entry, cached_tokens=cached)
        if escalation and cached is not None:
            self.stats.add("cached_tokens_on_escalation", cached)
        if enabled("info"):  # the ledger row as an event (sizes only): `agentkv report` reads a log of them
            emit("turn_answered", session=self._session, tenant=self._tenant,
                 **asdict(replace(entry, cached_tokens=cached)))

    def _count_cached(self, cached: int | None) -> None:
        """A response without ``prompt_tokens_details`` (vLLM without ``--enable-prompt-tokens-details``)
        is counted as unknown, never as 0 cached tokens."""
        if cached is None:
            self.stats.add("cached_tokens_unknown")
        else:
            self.stats.add("cached_tokens_total", cached)
