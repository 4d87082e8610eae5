"""Sending warm-ahead requests: one Session's guards in order, then a daemon thread or an asyncio task.

The decision is :func:`agentkv.warm.policy.decide_warm` (pure); :class:`WarmAhead` adds the stateful
guards (tenant-scoped cooldown, in-flight bound) through a :class:`~agentkv.state.StateStore` (one
process's, or a fleet's through Redis: unreachable, the warm is skipped), counts every outcome, and sends the
one-token request without ever blocking or raising into the caller. It is handed data (the request,
the client), never callbacks into the Session.

Threads are daemons and every warm has a timeout, so closing a Session or exiting the interpreter
never waits on one. Context variables are copied into the worker (a thread does not inherit them).
"""

from __future__ import annotations

import collections
import numbers
import time
from typing import Any, Awaitable, Callable, Mapping

from agentkv._support.jobs import BackgroundJobs
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
from agentkv.state.protocol import Lease, StateStore, StateUnavailable, WarmClaim
from agentkv.warm.aware import SlowResidency
from agentkv.warm.economics import TurnSample
from agentkv.warm.events import SENDS, EventOutcome
from agentkv.warm.policy import WarmAheadPolicy, WarmDecision, decide_warm
from agentkv.wire.usage import report_rejected, response_usage

__all__ = ["WarmAhead"]

_COUNTED_SKIPS = ("disabled", "unknown_model", "cooldown", "saturated", "state_unavailable", "break_even",
                  "below_cache_minimum", "cost")
_EVENT_COUNTERS = {"fire": "warm_fired", "skip_resident": "warm_skipped_resident",
                   "rewarm_evicted": "warm_rewarm_evicted", "top_up": "warm_top_up"}
_Job = Callable[[], Any]
_EVENT_SEP = "\x00"  # no tenant name holds it, so no tenant's cooldown map is another's event namespace


WarmTrace = tuple[Any, dict[str, Any]]  # the turn's span (the warm's parent) and the warm span's attributes


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


def event_namespace(tenant: str | None) -> str:
    """The namespace of a tenant's re-warm and top-up claims (a tenant named ``acme#event`` cannot reach acme's)."""
    return f"{tenant or ''}{_EVENT_SEP}event"


class WarmAhead:
    """Warm-ahead for one (tenant, session): ``consider``/``aconsider`` decide and claim through the
    :class:`~agentkv.state.StateStore`, ``send``/``asend`` go out and give the lease back.

    It keeps the conversation's last ``policy.growth_turns`` (``clock()``, tokens) samples for the
    break-even gate: bounded, and no I/O."""

    def __init__(self, policy: WarmAheadPolicy, store: StateStore, stats: SessionStats, jobs: BackgroundJobs,
                 *, session_id: str, tenant: str | None, clock: Callable[[], float] = time.monotonic,
                 tenant_key: str | None = None) -> None:
        self.policy = policy
        self._store, self._stats, self._jobs = store, stats, jobs
        if tenant is not None and _EVENT_SEP in tenant:
            raise ConfigurationError(f"a tenant name cannot contain {_EVENT_SEP!r} (it separates event-aware claims)")
        self._session_id, self._tenant = session_id, tenant
        # what the store's claims key the tenant by: a digest keyed by the salt secret (no name in a shared store)
        self._tenant_key = tenant if tenant_key is None else tenant_key
        self._lease: Lease | None = None
        self.warmed: Payload | None = None
        self.warmed_tokens: int | None = None  # the fired warm's estimated prompt tokens (what its escalation expects)
        self._clock = _checked_clock(clock)
        self.turns: collections.deque[TurnSample] = collections.deque(maxlen=policy.growth_turns)
        self.residency: SlowResidency | None = None
        self._pending: tuple[Payload, bool, bool] | None = None  # event-aware: payload, claimed, owns ``busy``
        self._events_claimed = 0
        self.span: Any = None  # the last warm's OpenTelemetry span (the escalation's link), None when not recorded
        self.replica: str | None = None  # the pool replica warms go to (a pool's slow backend), None otherwise
        self.ejections: Ejections | None = None  # where a replica found down by a warm is marked (a pool's)
        self.cooloff_s = DEFAULT_COOLOFF_S
        # the hosted slow model the next warm goes to and its call: what its answer's cache tokens and cost count for
        self.accounted: tuple[Backend, Mapping[str, Any]] | None = None

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

    def attach(self, residency: SlowResidency) -> None:
        """Make this session's warms event-aware: each is decided in its job from what the slow server holds."""
        self.residency = residency

    def wants_send(self, outcome: str) -> bool:
        """Whether the driver should build a warm for this outcome ("fire", or an event-aware check)."""
        return outcome == "fire" or self._pending is not None

    def _decide(self, inputs: dict[str, Any]) -> WarmDecision:
        """Record this request's sample, then ask the pure decision (history included)."""
        self.turns.append(TurnSample(self._clock(), int(inputs["estimated_tokens"])))
        return decide_warm(policy=self.policy, history=tuple(self.turns), **inputs)

    def consider(self, payload: Payload, **inputs: Any) -> str:
        """The outcome for this request ("fire" or why not), counted; a "fire" holds a lease.

        ``inputs``: :func:`~agentkv.warm.policy.decide_warm`'s keywords less ``policy`` and ``history``."""
        decision = self._decide(inputs)
        if not decision.fire:
            return self._counted(decision.outcome, payload, inputs)
        outcome: str
        try:
            outcome, self._lease = self._store.claim(self._claim())
        except StateUnavailable:
            outcome = "state_unavailable"
        return self._counted(outcome, payload, inputs)

    async def aconsider(self, payload: Payload, **inputs: Any) -> str:
        """The async twin of :meth:`consider`: the claim is awaited (an asyncio client, never a sync call)."""
        decision = self._decide(inputs)
        if not decision.fire:
            return self._counted(decision.outcome, payload, inputs)
        outcome: str
        try:
            outcome, self._lease = await self._store.aclaim(self._claim())
        except StateUnavailable:
            outcome = "state_unavailable"
        return self._counted(outcome, payload, inputs)

    def _claim(self) -> WarmClaim:
        p = self.policy
        session = self._session_id if self.replica is None else f"{self._session_id}@{self.replica}"
        return WarmClaim(self._tenant_key or "", session, p.cooldown_s, p.max_sessions, p.max_in_flight,
                         lease_s=p.timeout_s + 1.0)

    def _counted(self, outcome: str, payload: Payload, inputs: dict[str, Any]) -> str:
        if outcome in _COUNTED_SKIPS:
            self._stats.add(f"warm_skipped_{outcome}")
        self._pending = None
        if self.residency is not None and outcome in ("fire", "cooldown"):
            owns = self.residency.busy.acquire(blocking=False)
            if owns or outcome == "fire":  # a claimed warm is always decided; a check only when none runs
                # the prompt as sent: the job reads its ids later, and a sent warm becomes ``warmed``
                self._pending = (detached(payload, deep=True), outcome == "fire", owns)
            return outcome  # counted by the job, once it knows what the slow server holds
        if outcome == "fire":
            self._stats.add("warm_fired")
            self.warmed = detached(payload, deep=True)  # the warm's prompt, whatever the caller edits before escalating
            self.warmed_tokens = inputs.get("estimated_tokens")
            emit("warm_fired", estimate=inputs.get("estimated_tokens"), session=self._session_id, tenant=self._tenant)
        return outcome

    def moved(self, payload: Payload, tokens: int | None) -> bool:
        """The replica this conversation's warm sat on was found dead, and warms now go to its next replica
        (:meth:`retarget`): claim a warm there (the cooldown, an in-flight slot) for ``payload`` (``tokens``
        estimated), counted as a fired warm. True when the claim holds: the driver sends the warm now."""
        outcome: str
        try:
            outcome, lease = self._store.claim(self._claim())
        except StateUnavailable:
            outcome, lease = "state_unavailable", None
        return self._moved(outcome, lease, payload, tokens)

    async def amoved(self, payload: Payload, tokens: int | None) -> bool:
        """The async twin of :meth:`moved` (the claim is awaited)."""
        outcome: str
        try:
            outcome, lease = await self._store.aclaim(self._claim())
        except StateUnavailable:
            outcome, lease = "state_unavailable", None
        return self._moved(outcome, lease, payload, tokens)

    def _moved(self, outcome: str, lease: Lease | None, payload: Payload, tokens: int | None) -> bool:
        if outcome != "fire":
            if outcome in _COUNTED_SKIPS:
                self._stats.add(f"warm_skipped_{outcome}")
            return False
        self._lease, self._pending = lease, None  # sent plainly, at once: the driver's next call takes the lease
        self._stats.add("warm_fired")
        self.warmed, self.warmed_tokens = detached(payload, deep=True), tokens
        emit("warm_replica_moved", estimate=tokens, session=self._session_id, tenant=self._tenant,
             replica=self._shown_replica)
        return True

    def _take_lease(self) -> Lease | None:
        lease, self._lease = self._lease, None
        return lease

    def abandon(self, exc: BaseException) -> None:
        """A claimed warm that could not be built: free its slot and count the failure."""
        self._release(self._take_lease())
        pending, self._pending = self._pending, None
        if pending is not None and pending[2] and self.residency is not None:
            self.residency.busy.release()
        self._failed(exc)

    def _release(self, lease: Lease | None) -> None:
        if lease is None:
            return
        try:
            self._store.release(lease)
        except StateUnavailable:
            pass  # the lease expires on its own

    async def _arelease(self, lease: Lease | None) -> None:
        if lease is None:
            return
        try:
            await self._store.arelease(lease)
        except StateUnavailable:
            pass  # the lease expires on its own

    def send(self, call: dict[str, Any], client: Any, trace: WarmTrace | None = None) -> None:
        """Send ``call`` through ``client.completion`` on a daemon worker thread (in a span when ``trace`` is given:
        the turn's span, the warm span's attributes)."""
        self._on_thread(self._traced(lambda: client.completion(**call), trace))

    def asend(self, call: dict[str, Any], client: Any, trace: WarmTrace | None = None) -> None:
        """Send ``call`` through ``client.acompletion`` as a task bounded by the policy's timeout."""
        self._as_task(self._atraced(lambda: client.acompletion(**call), trace))

    def post(self, url: str, body: dict[str, Any], http: HttpTransport, headers: Mapping[str, str] | None = None,
             trace: WarmTrace | None = None) -> None:
        """POST the warm's raw ``body`` (with ``headers``) to ``url`` over the HTTP seam on a daemon worker thread."""
        self._on_thread(self._traced(lambda: http.request("POST", url, json=body, timeout_s=self.policy.timeout_s,
                                                          headers=headers), trace))

    def apost(self, url: str, body: dict[str, Any], http: HttpTransport, headers: Mapping[str, str] | None = None,
              trace: WarmTrace | None = None) -> None:
        """POST the warm's raw ``body`` (with ``headers``) to ``url`` over the async HTTP seam, as a task."""
        self._as_task(self._atraced(lambda: http.arequest("POST", url, json=body, timeout_s=self.policy.timeout_s,
                                                            headers=headers), trace))

    def _kept(self, span: Any) -> None:
        self.span = span

    def _traced(self, send: Callable[[], Any], trace: WarmTrace | None) -> Callable[[], Any]:
        if trace is None:
            return send
        model = trace[1].get("gen_ai.request.model")
        return traced(send, trace[0], f"agentkv.warm {model}", trace[1], on_start=self._kept)

    def _atraced(self, send: Callable[[], Awaitable[Any]], trace: WarmTrace | None) -> Callable[[], Awaitable[Any]]:
        if trace is None:
            return send
        model = trace[1].get("gen_ai.request.model")
        return atraced(send, trace[0], f"agentkv.warm {model}", trace[1], on_start=self._kept)

    def _on_thread(self, send: Callable[[], Any]) -> None:
        lease, replica = self._take_lease(), self.replica  # the replica this warm goes to, whatever comes next
        pending, self._pending = self._pending, None
        if pending is not None:
            self._jobs.thread(lambda: self._checked(send, lease, *pending, replica=replica))
            return

        accounted, self.accounted = self.accounted, None

        def job() -> None:
            try:
                response = send()
                self._stats.add("warm_completed")
                self._answered_by(replica)
                self._account(accounted, response)
            except Exception as exc:  # a warm never raises into anyone
                self._failed(exc, replica)
            finally:
                self._release(lease)

        self._jobs.thread(job)

    def _as_task(self, send: Callable[[], Awaitable[Any]]) -> None:
        lease, replica = self._take_lease(), self.replica
        pending, self._pending = self._pending, None
        if pending is not None:
            self._jobs.task(self._achecked(send, lease, *pending, replica=replica),
                            self.policy.timeout_s + 2 + 2 * self._settle_s())
            return

        accounted, self.accounted = self.accounted, None

        async def job() -> None:
            try:
                response = await send()
                self._stats.add("warm_completed")
                self._answered_by(replica)
                self._account(accounted, response)
            except Exception as exc:  # a warm never raises into anyone
                await self._aeject(exc, replica)
                self._failed(exc)
            finally:
                await self._arelease(lease)

        self._jobs.task(job(), self.policy.timeout_s + 1.0)

    def _account(self, accounted: tuple[Backend, Mapping[str, Any]] | None, response: Any) -> None:
        """A hosted warm's cache writes and dollars into the stats, and the explicit cache it created noted (a warm
        never raises into anyone)."""
        if accounted is None:
            return
        backend, _ = accounted
        try:
            usage = response_usage(response)
            report_rejected(usage, backend=backend.label, session=self._session_id, warm=True)
            account(self._stats, backend, usage, warm=True, session=self._session_id)
        except Exception as exc:
            emit("warm_cost_unread", level="warning", error=type(exc).__name__, session=self._session_id)

    # --- event-aware: decide in the job from what the slow server holds, then send or skip -------------

    def _settle_s(self) -> float:
        return self.residency.settle_s if self.residency is not None else 0.0

    def _checked(self, send: Callable[[], Any], lease: Lease | None, payload: Payload, claimed: bool,
                 owns: bool, *, replica: str | None = None) -> None:
        """A worker thread's event-aware warm: the slow server's ids, the ledger, the decision, the send."""
        residency = self.residency
        assert residency is not None
        try:
            ids, exact = residency.counter.token_ids(payload)
            outcome = self._judged(residency.outcome(ids, exact, claimed=claimed, policy=self.policy), ids)
            if outcome in SENDS and not claimed:
                lease = self._event_lease(*self._try_claim(self._store.claim))
            if outcome in SENDS and (claimed or lease is not None):
                sent_at = time.time()  # the publishers' clock, as the Session stamps a request for its prediction
                response = send()
                self._answered_by(replica)
                self._sent(outcome, payload)
                residency.record_warm(ids, exact, sent_at, response)
                residency.settle(ids)
        except Exception as exc:  # a warm never raises into anyone
            self._failed(exc, replica)
        finally:
            self._release(lease)
            if owns:
                residency.busy.release()

    async def _achecked(self, send: Callable[[], Awaitable[Any]], lease: Lease | None, payload: Payload,
                        claimed: bool, owns: bool, *, replica: str | None = None) -> None:
        """The async twin of :meth:`_checked` (``/tokenize`` and the claim are awaited)."""
        residency = self.residency
        assert residency is not None
        try:
            ids, exact = await residency.counter.atoken_ids(payload)
            outcome = self._judged(residency.outcome(ids, exact, claimed=claimed, policy=self.policy), ids)
            if outcome in SENDS and not claimed:
                lease = self._event_lease(*await self._atry_claim())
            if outcome in SENDS and (claimed or lease is not None):
                sent_at = time.time()
                response = await send()
                self._answered_by(replica)
                self._sent(outcome, payload)
                residency.record_warm(ids, exact, sent_at, response)
                await residency.asettle(ids)
        except Exception as exc:  # a warm never raises into anyone
            await self._aeject(exc, replica)
            self._failed(exc)
        finally:
            await self._arelease(lease)
            if owns:
                residency.busy.release()

    def _judged(self, outcome: EventOutcome, ids: list[int]) -> EventOutcome:
        """Count a skip (and take a resident prompt as this session's warmed prefix)."""
        if outcome == "skip_resident":
            self._stats.add("warm_skipped_resident")
            emit("warm_skipped_resident", session=self._session_id, tenant=self._tenant, replica=self._shown_replica)
            assert self.residency is not None
            self.residency.remember(ids)
        return outcome

    def _event_claim(self) -> WarmClaim:
        """A re-warm's or top-up's claim: an in-flight slot, under the tenant's own event namespace (so its short
        marker never shortens, crowds or expires the tenant's cooldowns) and a key of its own (the session's one
        check at a time, :attr:`SlowResidency.busy`, is what spaces them)."""
        p = self.policy
        self._events_claimed += 1
        return WarmClaim(event_namespace(self._tenant_key), f"{self._session_id}#{self._events_claimed}", p.timeout_s + 1.0,
                         p.max_sessions, p.max_in_flight, lease_s=p.timeout_s + 1.0)

    def _try_claim(self, claim: Callable[[WarmClaim], tuple[str, Lease | None]]) -> tuple[str, Lease | None]:
        try:
            return claim(self._event_claim())
        except StateUnavailable:
            return "state_unavailable", None

    async def _atry_claim(self) -> tuple[str, Lease | None]:
        try:
            return await self._store.aclaim(self._event_claim())
        except StateUnavailable:
            return "state_unavailable", None

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
        if replica is not None and self.ejections is not None:
            self.ejections.judge(replica, "ok", session=self._session_id, tenant=self._tenant)

    def _evidence(self, exc: BaseException, replica: str | None) -> tuple[str, Evidence] | None:
        """``replica`` (the pool replica the warm went to) and what its error says about it (a refusal or reset: down;
        another outage: a failure of this request, for its breaker to weigh; a slow answer, a timeout: nothing)."""
        if replica is None or self.ejections is None:
            return None
        evidence = replica_evidence(exc, fails_over=is_outage(exc))
        return None if evidence is None else (replica, evidence)

    async def _aeject(self, exc: BaseException, replica: str | None) -> None:
        failed = self._evidence(exc, replica)
        if failed is not None and self.ejections is not None:
            await self.ejections.aobserve(*failed, session=self._session_id, tenant=self._tenant,
                                          cooloff_s=self.cooloff_s)

    def _failed(self, exc: BaseException, replica: str | None = None) -> None:
        """Count a warm that failed; ``replica``: the pool replica it went to (its breaker told: ejected on evidence
        that it is down, and the next turn moves and re-warms)."""
        failed = self._evidence(exc, replica)
        if failed is not None and self.ejections is not None:
            self.ejections.observe(*failed, session=self._session_id, tenant=self._tenant, cooloff_s=self.cooloff_s)
        self._stats.add("warm_failed")
        emit("warm_failed", level="warning", error=type(exc).__name__,
             status_code=getattr(exc, "status_code", None), session=self._session_id, tenant=self._tenant)
