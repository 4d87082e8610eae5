"""Sending warm-ahead requests, as a decision, a plan and an executor.

The decision is :func:`agentkv.warm.policy.decide_warm` (pure). :meth:`WarmAhead.considering` adds the stateful guards
(tenant-scoped cooldown, in-flight bound: :mod:`agentkv.warm.claims`, through a :class:`~agentkv.state.StateStore`, one
process's or a fleet's through Redis: unreachable, the warm is skipped), counts every outcome, and returns a
:class:`Claimed`. The turn builds a :class:`WarmPlan` from it (what is sent, to which replica, under which lease, and
whether its send waits on what the slow server holds) and spawns :meth:`WarmAhead.sending`, the executor: a machine
(:mod:`agentkv._support.effects`) that reads only its plan, run on a daemon thread or as a task, never blocking or
raising into the caller. No one sets a field of the sender: it is handed data, never callbacks into the Session.

Threads are daemons and every warm has a timeout, so closing a Session or exiting the interpreter never waits on one.
"""

from __future__ import annotations

import collections
import numbers
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Mapping

from agentkv._support.effects import Call, Machine, Raised
from agentkv.http.transport import HttpTransport, redact_url
from agentkv.errors import ConfigurationError
from agentkv.backends import Backend
from agentkv.providers import account
from agentkv.retry import is_outage, replica_evidence
from agentkv.events import emit
from agentkv.stats import SessionStats
from agentkv.telemetry.otel import atraced, traced
from agentkv.tokens import Payload
from agentkv.tokens.payload import detached
from agentkv.fleet.breaker import Evidence
from agentkv.state.ejections import DEFAULT_COOLOFF_S, Ejections
from agentkv.state.protocol import Lease, StateStore
from agentkv.warm.aware import SlowResidency
from agentkv.warm.claims import EVENT_SEP, claimed, conversation_claim, event_claim, event_namespace, released
from agentkv.warm.economics import TurnSample
from agentkv.warm.events import SENDS, EventOutcome
from agentkv.warm.policy import WarmAheadPolicy, WarmDecision, decide_warm
from agentkv.wire.usage import report_rejected, response_usage

__all__ = ["COUNTED_SKIPS", "Claimed", "WarmAhead", "WarmPlan", "WarmRequest", "event_namespace"]

COUNTED_SKIPS = ("disabled", "unknown_model", "cooldown", "saturated", "state_unavailable", "break_even",
                  "below_cache_minimum", "cost")
_EVENT_COUNTERS = {"fire": "warm_fired", "skip_resident": "warm_skipped_resident",
                   "rewarm_evicted": "warm_rewarm_evicted", "top_up": "warm_top_up"}


WarmTrace = tuple[Any, dict[str, Any]]  # the turn's span (the warm's parent) and the warm span's attributes


@dataclass(frozen=True)
class Claimed:
    """What :meth:`WarmAhead.considering` decided for a request: its ``outcome`` ("fire" or why not) and the
    ``lease`` a fired warm holds; ``check``: the send is decided in the job from what the slow server holds
    (event-aware), for ``payload`` (the prompt as sent), ``claimed`` saying whether it holds the conversation's
    claim and ``owns`` whether it holds the residency's one check at a time."""

    outcome: str
    lease: Lease | None = None
    check: bool = False
    claimed: bool = False
    owns: bool = False
    payload: Payload | None = field(default=None, repr=False)

    @property
    def sends(self) -> bool:
        """Whether a warm is built and spawned for this request."""
        return self.outcome == "fire" or self.check


@dataclass(frozen=True)
class WarmRequest:
    """A warm's request: a raw POST of ``body`` (with ``headers``) to ``url``, or, with no ``url``, ``call`` (litellm
    kwargs) through the Session's completion client."""

    url: str | None = field(default=None, repr=False)  # URLs may carry credentials: never in a repr
    body: Mapping[str, Any] | None = field(default=None, repr=False)
    headers: Mapping[str, str] | None = field(default=None, repr=False)
    call: Mapping[str, Any] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class WarmPlan:
    """Everything :meth:`WarmAhead.sending` acts on: the claim, the request, the pool ``replica`` it goes to (None:
    not a pool), the managed slow backend whose answer is ``accounted`` (cost, cache writes), the ``trace`` (the
    turn's span and the warm span's attributes) and, for a check, the ``residency`` it reads."""

    claimed: Claimed
    request: WarmRequest
    replica: str | None = field(default=None, repr=False)  # a replica's URL may carry credentials
    accounted: Backend | None = None
    trace: WarmTrace | None = None
    residency: SlowResidency | None = None


def _checked_clock(clock: Callable[[], float]) -> Callable[[], float]:
    """The Session's ``clock``, read once here: a value that is not a callable returning a real number (say
    ``datetime.now``) is refused now, not as an error out of a later request once the break-even gate reads it."""
    try:
        reading = clock()
    except Exception as exc:
        raise ConfigurationError(f"Session.clock must be a callable returning seconds, got {clock!r}") from exc
    if isinstance(reading, bool) or not isinstance(reading, numbers.Real):
        raise ConfigurationError(f"Session.clock must return seconds as a number, got {reading!r} from {clock!r}")
    return clock


class WarmAhead:
    """Warm-ahead for one (tenant, session): :meth:`considering` decides and claims, :meth:`sending` executes a
    :class:`WarmPlan` and gives the lease back.

    It keeps the conversation's last ``policy.growth_turns`` (``clock()``, tokens) samples for the
    break-even gate: bounded, and no I/O. ``ejections``: where a pool replica a warm found down is marked."""

    def __init__(self, policy: WarmAheadPolicy, store: StateStore, stats: SessionStats,
                 *, session_id: str, tenant: str | None, clock: Callable[[], float] = time.monotonic,
                 tenant_key: str | None = None, ejections: Ejections | None = None,
                 cooloff_s: float = DEFAULT_COOLOFF_S) -> None:
        self.policy = policy
        self._store, self._stats = store, stats
        if tenant is not None and EVENT_SEP in tenant:
            raise ConfigurationError(f"a tenant name cannot contain {EVENT_SEP!r} (it separates event-aware claims)")
        self._session_id, self._tenant = session_id, tenant
        # what the store's claims key the tenant by: a digest keyed by the salt secret (no name in a shared store)
        self._tenant_key = tenant if tenant_key is None else tenant_key
        self.warmed: Payload | None = None
        self.warmed_tokens: int | None = None  # the fired warm's estimated prompt tokens (what its escalation expects)
        self._clock = _checked_clock(clock)
        self.turns: collections.deque[TurnSample] = collections.deque(maxlen=policy.growth_turns)
        self.residency: SlowResidency | None = None
        self._events_claimed = 0
        self.span: Any = None  # the last warm's OpenTelemetry span (the escalation's link), None when not recorded
        self.replica: str | None = None  # the pool replica warms go to (a pool's slow backend), None otherwise
        self._ejections, self._cooloff_s = ejections, cooloff_s

    @property
    def _shown_replica(self) -> str | None:
        """The replica as events show it (no credentials)."""
        return None if self.replica is None else redact_url(self.replica)

    def retarget(self, replica: str | None) -> None:
        """Warms now go to ``replica`` (a pool's, for this conversation): a warm on another replica no longer counts,
        and the cooldown is claimed per replica, so a conversation moved to a new replica is warmed there again."""
        if replica != self.replica:
            if self.replica is not None:
                self.warmed, self.warmed_tokens = None, None
            self.replica = replica

    def follow(self, residency: SlowResidency | None) -> None:
        """Decide this session's warms from what ``residency`` shows the slow server holds (event-aware), or, with
        None, by the cooldown alone (a pool replica the ledger does not follow)."""
        self.residency = residency

    def _decide(self, inputs: dict[str, Any]) -> WarmDecision:
        """Record this request's sample, then ask the pure decision (history included)."""
        self.turns.append(TurnSample(self._clock(), int(inputs["estimated_tokens"])))
        return decide_warm(policy=self.policy, history=tuple(self.turns), **inputs)

    # ----------------------------------------------------------------- the decision and its claim

    def considering(self, payload: Payload, **inputs: Any) -> Machine[Claimed]:
        """The outcome for this request ("fire" or why not), counted; a "fire" holds a lease.

        ``inputs``: :func:`~agentkv.warm.policy.decide_warm`'s keywords less ``policy`` and ``history``."""
        decision = self._decide(inputs)
        if not decision.fire:
            return self._counted(Claimed(decision.outcome), payload, inputs)
        outcome, lease = yield from claimed(self._store, self._claim())
        return self._counted(Claimed(outcome, lease), payload, inputs)

    def _claim(self) -> Any:
        return conversation_claim(self.policy, self._tenant_key, self._session_id, self.replica)

    def _counted(self, claim: Claimed, payload: Payload, inputs: dict[str, Any]) -> Claimed:
        """The claim, made a check where the slow server's cache decides; a plain fire's prompt kept as the warmed
        one. (The outcome is counted and logged by the turn's ``warmed`` event: :mod:`agentkv._session.pipeline`.)"""
        outcome = claim.outcome
        if self.residency is not None and outcome in ("fire", "cooldown"):
            owns = self.residency.busy.acquire(blocking=False)
            if owns or outcome == "fire":  # a claimed warm is always decided; a check only when none runs
                # the prompt as sent: the job reads its ids later, and a sent warm becomes ``warmed``
                return replace(claim, check=True, claimed=outcome == "fire", owns=owns,
                               payload=detached(payload, deep=True))
            return claim  # counted by the job, once it knows what the slow server holds
        if outcome == "fire":
            self.warmed = detached(payload, deep=True)  # the warm's prompt, whatever the caller edits before escalating
            self.warmed_tokens = inputs.get("estimated_tokens")
        return claim

    def moving(self, payload: Payload, tokens: int | None) -> Machine[Claimed]:
        """The replica this conversation's warm sat on was found dead, and warms now go to its next replica
        (:meth:`retarget`): claim a warm there (the cooldown, an in-flight slot) for ``payload`` (``tokens``
        estimated), counted as a fired warm. A "fire" holds the lease: the turn sends the warm now."""
        outcome, lease = yield from claimed(self._store, self._claim())
        if outcome != "fire":
            if outcome in COUNTED_SKIPS:
                self._stats.add(f"warm_skipped_{outcome}")
            return Claimed(outcome)
        self._stats.add("warm_fired")
        self.warmed, self.warmed_tokens = detached(payload, deep=True), tokens
        emit("warm_replica_moved", estimate=tokens, session=self._session_id, tenant=self._tenant,
             replica=self._shown_replica)
        return Claimed("fire", lease)

    def abandoning(self, claim: Claimed, exc: BaseException) -> Machine[None]:
        """A claimed warm that could not be built: free its slot and count the failure."""
        if claim.owns and self.residency is not None:
            self.residency.busy.release()
        self._failed(exc)
        yield from released(self._store, claim.lease)

    def timeout_s(self, plan: WarmPlan) -> float:
        """How long :meth:`sending` ``plan`` may take as a task: the warm's timeout, and a check's settling."""
        if plan.claimed.check and plan.residency is not None:
            return self.policy.timeout_s + 2 + 2 * plan.residency.settle_s
        return self.policy.timeout_s + 1.0

    # ----------------------------------------------------------------- the executor

    def sending(self, plan: WarmPlan, http: HttpTransport, client: Any) -> Machine[None]:
        """Execute ``plan`` (the turn spawns it: never raises into anyone): its request over ``http`` (a raw POST) or
        through ``client``, its answer accounted, its lease given back."""
        if plan.claimed.check and plan.residency is not None:
            yield from self._checking(plan, plan.residency, http, client)
            return
        try:
            answer = yield from self._sent_request(plan, http, client)
            if isinstance(answer, Raised):
                yield from self._failing(answer.error, plan.replica)
            else:
                self._stats.add("warm_completed")
                self._answered_by(plan.replica)
                self._account(plan.accounted, answer.value)
        finally:  # timed out or cancelled too: the slot is given back
            yield from released(self._store, plan.claimed.lease)

    def _sent_request(self, plan: WarmPlan, http: HttpTransport, client: Any) -> Machine[Any]:
        """The plan's request as one effect (in a span when the plan has a trace); what it returned or raised."""
        request = plan.request
        send: Callable[[], Any]
        asend: Callable[[], Any]
        if request.url is not None:
            kwargs: dict[str, Any] = {"json": dict(request.body or {}), "timeout_s": self.policy.timeout_s,
                                      "headers": request.headers}
            send = partial(http.request, "POST", request.url, **kwargs)
            asend = partial(http.arequest, "POST", request.url, **kwargs)
        else:
            send = partial(client.completion, **(request.call or {}))
            asend = partial(client.acompletion, **(request.call or {}))
        if plan.trace is not None:
            name = f"agentkv.warm {plan.trace[1].get('gen_ai.request.model')}"
            send = traced(send, plan.trace[0], name, plan.trace[1], on_start=self._kept)
            asend = atraced(asend, plan.trace[0], name, plan.trace[1], on_start=self._kept)
        return (yield Call(send, asend, captures=True))

    def _kept(self, span: Any) -> None:
        self.span = span

    def _checking(self, plan: WarmPlan, residency: SlowResidency, http: HttpTransport, client: Any) -> Machine[None]:
        """An event-aware warm: the slow server's ids, the ledger, the decision, the send, the settling."""
        held = [plan.claimed.lease]  # the lease held now (a re-warm's or a top-up's is claimed on the way)
        try:
            yield from self._checked(plan, residency, http, client, held)
        except Exception as exc:  # a warm never raises into anyone
            yield from self._failing(exc, plan.replica)
        finally:  # cancelled too: the session's one check at a time is free again, and the slot given back
            if plan.claimed.owns:
                residency.busy.release()
            yield from released(self._store, held[0])

    def _checked(self, plan: WarmPlan, residency: SlowResidency, http: HttpTransport, client: Any,
                 held: list[Lease | None]) -> Machine[None]:
        claim, payload = plan.claimed, plan.claimed.payload
        assert payload is not None
        ids, exact = yield from residency.counter.ids(payload)
        outcome = self._judged(residency.outcome(ids, exact, claimed=claim.claimed, policy=self.policy), ids)
        if outcome in SENDS and not claim.claimed:
            held[0] = self._event_lease(*(yield from claimed(self._store, self._event_claim())))
        if outcome in SENDS and (claim.claimed or held[0] is not None):
            sent_at = time.time()  # the publishers' clock, as the Session stamps a request for its prediction
            answer = yield from self._sent_request(plan, http, client)
            if isinstance(answer, Raised):
                raise answer.error
            self._answered_by(plan.replica)
            self._sent(outcome, payload)
            residency.record_warm(ids, exact, sent_at, answer.value)
            yield from residency.settling(ids)

    def _account(self, backend: Backend | None, response: Any) -> None:
        """A managed warm's cache writes and dollars into the stats (a warm never raises into anyone)."""
        if backend is None:
            return
        try:
            usage = response_usage(response)
            report_rejected(usage, backend=backend.label, session=self._session_id, warm=True)
            account(self._stats, backend, usage, warm=True, session=self._session_id)
        except Exception as exc:
            emit("warm_cost_unread", level="warning", error=type(exc).__name__, session=self._session_id)

    def _judged(self, outcome: EventOutcome, ids: list[int]) -> EventOutcome:
        """Count a skip (and take a resident prompt as this session's warmed prefix)."""
        if outcome == "skip_resident":
            self._stats.add("warm_skipped_resident")
            emit("warm_skipped_resident", session=self._session_id, tenant=self._tenant, replica=self._shown_replica)
            assert self.residency is not None
            self.residency.remember(ids)
        return outcome

    def _event_claim(self) -> Any:
        """A re-warm's or top-up's claim (:func:`agentkv.warm.claims.event_claim`), the session's next."""
        self._events_claimed += 1
        return event_claim(self.policy, self._tenant_key, self._session_id, self._events_claimed)

    def _event_lease(self, outcome: str, lease: Lease | None) -> Lease | None:
        if outcome in ("saturated", "state_unavailable"):
            self._stats.add(f"warm_skipped_{outcome}")
        return lease

    def _sent(self, outcome: EventOutcome, payload: Payload) -> None:
        self._stats.add(_EVENT_COUNTERS[outcome])
        self._stats.add("warm_completed")
        self.warmed = payload
        emit(f"warm_{outcome}", session=self._session_id, tenant=self._tenant, replica=self._shown_replica)

    def _answered_by(self, replica: str | None) -> None:
        """The pool replica the warm went to answered it: its breaker's streak starts again (no I/O)."""
        if replica is not None and self._ejections is not None:
            self._ejections.judge(replica, "ok", session=self._session_id, tenant=self._tenant)

    def _evidence(self, exc: BaseException, replica: str | None) -> tuple[str, Evidence] | None:
        """``replica`` (the pool replica the warm went to) and what its error says about it (a refusal or reset: down;
        another outage: a failure of this request, for its breaker to weigh; a slow answer, a timeout: nothing)."""
        if replica is None or self._ejections is None:
            return None
        evidence = replica_evidence(exc, fails_over=is_outage(exc))
        return None if evidence is None else (replica, evidence)

    def _failing(self, exc: BaseException, replica: str | None) -> Machine[None]:
        """Count a warm that failed; ``replica``: the pool replica it went to (its breaker told: ejected on evidence
        that it is down, and the next turn moves and re-warms)."""
        failed = self._evidence(exc, replica)
        if failed is not None and self._ejections is not None:
            yield Call(self._ejections.observe, self._ejections.aobserve, failed,
                       {"session": self._session_id, "tenant": self._tenant, "cooloff_s": self._cooloff_s},
                       captures=True)
        self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self._stats.add("warm_failed")
        emit("warm_failed", level="warning", error=type(exc).__name__,
             status_code=getattr(exc, "status_code", None), session=self._session_id, tenant=self._tenant)
