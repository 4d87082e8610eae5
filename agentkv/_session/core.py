"""The Session's state and its internal steps: gathering inputs (the only I/O), planning, warm-ahead, and what
happens at and after an answer. :class:`~agentkv._session.driver.Session` adds the drivers on top, through
:class:`~agentkv._session.reactive.ReactivePath` and :class:`~agentkv._session.external.SendsOutside`.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping

import agentkv._env as _env
from agentkv._http import HttpTransport, default_http
from agentkv._session.attempts import (
    Attempt, LitellmSends, raw_warm_target, warm_body, warm_kwargs,
)
from agentkv._session.decide import Action, Outcome, next_action
from agentkv._session.warm_prefix import schedule_warm_prefix_check
from agentkv._session.inputs import Facts, check_backends, check_timeout, max_tokens_of, request_payload, to_facts
from agentkv._session.prediction import Prediction, schedule_prediction
from agentkv._session.record import Recorder
from agentkv.wire.usage import Usage, server_clamped
from agentkv.backends import Backend
from agentkv.discovery import WindowDiscovery, discovery_for
from agentkv.errors import ContextOverflowError
from agentkv.events import emit, enabled, prompt_fields
from agentkv.handoff.escalation import Handoff
from agentkv.protocols import CompletionClient
from agentkv.retry import RetryPolicy
from agentkv.routing import RouteDecision, RoutePolicy, decide_route, interval_decides, is_escalation
from agentkv.stats import SessionStats
from agentkv.tenancy import keeps_caller_salt, resolve_cache_salt, screen_caller_salts
from agentkv.tokens import Payload, TokenCount, TokenCounter
from agentkv.tokens.payload import detached
from agentkv.state import StateStore
from agentkv.state.config import resolve_state
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy
from agentkv.warm.aware import SlowResidency
from agentkv.warm.sender import BackgroundJobs, WarmAhead

if TYPE_CHECKING:
    from agentkv.cache_ledger import CacheLedger

DEFAULT_REQUEST_TIMEOUT_S = 600.0

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "SessionCore"]


class SessionCore:
    """A Session's configuration and state, and the steps its drivers share (see :class:`~agentkv.Session`)."""

    def __init__(
        self,
        fast: Backend,
        slow: Backend | None = None,
        *,
        tenant: str | None = None,
        session_id: str | None = None,
        routing: RoutePolicy = RoutePolicy(),
        warm_ahead: WarmAheadPolicy = WarmAheadPolicy(),
        retry: RetryPolicy = RetryPolicy(),
        discovery: WindowDiscovery | None = None,
        cooldowns: CooldownMap | None = None,
        in_flight: InFlightLimit | None = None,
        state: StateStore | None = None,
        cache_salt: str | bool | None = None,
        cache_salt_secret: str | None = None,
        request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
        client: CompletionClient | None = None,
        count_with_server: bool = True,
        http: HttpTransport | None = None,
        handoff: str | Handoff = "replay",
        mapper: Any = None,
        min_attention_cosine: float | None = None,
        count_exactly: bool = False,
        ledger: CacheLedger | None = None,
        clock: Callable[[], float] | None = None,
        ledger_rows: int | None = None,
    ) -> None:
        check_backends(fast, slow)
        self.fast, self.slow = fast, slow
        self.tenant = tenant
        self.session_id = session_id or str(uuid.uuid4())
        self.routing, self.warm_ahead, self.retry = routing, warm_ahead, retry
        self.state = resolve_state(state, cooldowns, in_flight)
        self.discovery = discovery or discovery_for(self.state)
        self.cache_salt = resolve_cache_salt(tenant, cache_salt, cache_salt_secret or _env.cache_salt_secret(),
                                             self_hosted=any(b.api_base for b in self._backends()))
        self.request_timeout_s = check_timeout(request_timeout_s)
        self.client: CompletionClient = client if client is not None else _env.LazyLitellm()
        self.http: HttpTransport = http or default_http()
        self.counters = {b.label: TokenCounter.for_backend(b, use_server=count_with_server, http=self.http,
                                                           estimate_first=not count_exactly)
                         for b in self._backends()}
        self.handoff = handoff if isinstance(handoff, Handoff) else Handoff(
            handoff, mapper, min_attention_cosine=min_attention_cosine)
        self._stats = SessionStats()
        self.last_route: RouteDecision | None = None
        self._history: list[Payload] = []
        self._jobs = BackgroundJobs()
        self._warm = WarmAhead(warm_ahead, self.state, self._stats, self._jobs, session_id=self.session_id,
                               tenant=tenant, clock=clock or time.monotonic)
        self._record = Recorder(self._stats, rows=ledger_rows)
        self._sends = LitellmSends()  # the tools as litellm sends them, rebuilt when the caller's change
        self.cache_ledger = ledger
        if ledger is not None and slow is not None and ledger.follows(slow):
            self._warm.attach(SlowResidency(ledger, slow, self.cache_salt, self._counter(slow)))
        self.closed = False

    # ----------------------------------------------------------------- gathering inputs (the only I/O)

    def _facts(self) -> Facts:
        fast = self.discovery.window(self.fast, model_known=False)
        slow = self.discovery.window(self.slow) if self.slow is not None else None
        return to_facts(self.fast, self.slow, fast, slow)

    async def _afacts(self) -> Facts:
        fast = await self.discovery.awindow(self.fast, model_known=False)
        slow = await self.discovery.awindow(self.slow) if self.slow is not None else None
        return to_facts(self.fast, self.slow, fast, slow)

    def _counter(self, backend: Backend) -> TokenCounter:
        return self.counters[backend.label]

    def _count(self, kwargs: Mapping[str, Any], payload: Payload, facts: Facts) -> TokenCount:
        """Fast's count: the local estimate, or the exact one where a decision depends on it."""
        return self._counter(self.fast).count_for(payload, self._decides(kwargs, facts))

    async def _acount(self, kwargs: Mapping[str, Any], payload: Payload, facts: Facts) -> TokenCount:
        return await self._counter(self.fast).acount_for(payload, self._decides(kwargs, facts))

    def _decides(self, kwargs: Mapping[str, Any], facts: Facts) -> Callable[[int, int], bool]:
        warm = self.warm_ahead.threshold if self.slow is not None else None
        return functools.partial(interval_decides, max_tokens=max_tokens_of(kwargs), fast=facts.fast, slow=facts.slow,
                                 policy=self.routing, warm_threshold=warm)

    def _recount(self, attempt: Attempt) -> TokenCount:
        """The failed backend's count of the request: fast's exact count is reused, others are asked (and an
        exact answer teaches that backend's estimate bound)."""
        if attempt.count.exact and attempt.backend is self.fast:
            return attempt.count
        return self._learned(attempt, self._counter(attempt.backend).count(attempt.payload))

    async def _arecount(self, attempt: Attempt) -> TokenCount:
        if attempt.count.exact and attempt.backend is self.fast:
            return attempt.count
        return self._learned(attempt, await self._counter(attempt.backend).acount(attempt.payload))

    def _learned(self, attempt: Attempt, count: TokenCount) -> TokenCount:
        if count.exact:
            self._counter(attempt.backend).learn(attempt.payload, count.total, origin="recovery")
        return count

    # ----------------------------------------------------------------- planning (no I/O below here)

    def _open_request(self, kwargs: dict[str, Any], *, text: bool = False) -> Payload:
        """The request's payload, checked; ``text``: a prompt-only body (a text completion) is accepted too."""
        if self.closed:
            raise RuntimeError(f"Session {self.session_id!r} is closed")
        max_tokens_of(kwargs)  # a bad budget is refused before any count or network call
        screen_caller_salts(kwargs, self.cache_salt, keep=self._keeps_caller_salt, session=self.session_id,
                            tenant=self.tenant)  # so is a bad salt of the caller's own; another is replaced
        payload = request_payload(kwargs, self._backends(), self.counters.values())
        if payload.messages is None and not text:
            raise ValueError("Session.completion needs 'messages'; 'prompt' alone is a text completion")
        self._history = [*self._history[-1:], detached(payload)]  # as sent, whatever the caller edits later
        return payload

    def _backends(self) -> list[Backend]:
        return [b for b in (self.fast, self.slow) if b is not None]

    def _backend(self, role: str) -> Backend:
        return self.slow if role == "slow" and self.slow is not None else self.fast

    def _decide(self, kwargs: dict[str, Any], count: TokenCount, facts: Facts) -> RouteDecision:
        return decide_route(route_tokens=count.total, safe_tokens=count.safe, max_tokens=max_tokens_of(kwargs),
                            fast=facts.fast, slow=facts.slow, policy=self.routing, count_source=count.source)

    def _plan(self, kwargs: dict[str, Any], payload: Payload, count: TokenCount, facts: Facts) -> Attempt:
        try:
            decision = self._decide(kwargs, count, facts)
        except ContextOverflowError:
            self._stats.add("slow_overflow_refusals")
            raise
        if decision.note:
            self._stats.add("catalog_refusals")
        self._log_route(decision, count)
        return Attempt(decision, self._backend(decision.role), kwargs, payload, count, self.cache_salt,
                       timeout_s=self.request_timeout_s, sent_at=self._stamp(),
                       keeps_caller_salt=self._keeps_caller_salt)

    @property
    def _keeps_caller_salt(self) -> bool:
        return keeps_caller_salt(self.tenant, self.cache_salt)

    def _stamp(self) -> float | None:
        """The publishers' clock now (vLLM stamps event batches with ``time.time()``; the prediction reads the ledger
        as of it, whatever clock the ledger was given); None without a ledger."""
        return time.time() if self.cache_ledger is not None else None

    def _log_route(self, decision: RouteDecision, count: TokenCount) -> None:
        self.last_route = decision
        emit(
            "route", reason=decision.reason, target=decision.backend, role=decision.role,
            estimate=decision.estimated_input_tokens, floor=self.routing.output_floor, window=decision.window,
            max_tokens=decision.max_tokens, count_source=count.source, exact=count.exact,
            tool_tokens=count.tools, session=self.session_id, tenant=self.tenant, note=decision.note or None,
            **(prompt_fields(self._history[-1] if self._history else None) if enabled("info") else {}),
        )

    # ----------------------------------------------------------------- at and after the answer

    def _finish(self, attempt: Attempt, response: Any, *, asynchronous: bool) -> Any:
        self.handoff.answered(attempt.handoff_export, response, self._stats)  # what slow loaded for the import named
        escalation = is_escalation(self._record.previous_role, attempt.decision)
        warmed = self._warm.warmed
        prediction = self._predict(attempt, asynchronous)

        def on_usage(usage: Usage) -> None:
            if prediction is not None:
                prediction.reported(usage.cached_tokens)
            self._answered_usage(attempt, usage)

        result = self._record.finish(attempt, response, escalation=escalation, after_warm=warmed is not None,
                                     on_usage=on_usage)
        if escalation and warmed is not None:
            self._check_warm_prefix(warmed, attempt, asynchronous)
        return result

    def _answered_usage(self, attempt: Attempt, usage: Usage) -> None:
        """What an answer's usage teaches: the server's exact prompt count trains the backend's estimate bound,
        and a silent server clamp (vLLM 0.32: 200, ``finish_reason`` "length", fewer tokens than sent) is
        recorded and sends discovery back to the server for the real window."""
        if usage.prompt_tokens is not None:
            self._counter(attempt.backend).learn(attempt.payload, usage.prompt_tokens, origin="usage")
        if server_clamped(usage, attempt.decision.max_tokens):
            self._record.server_clamp(attempt, usage, session=self.session_id, tenant=self.tenant)
            self.discovery.rediscover(attempt.backend)

    def _predict(self, attempt: Attempt, asynchronous: bool) -> Prediction | None:
        """Start the ledger's prediction for a request to a backend it follows (worked out in the background)."""
        ledger, sent_at = self.cache_ledger, attempt.sent_at
        if ledger is None or sent_at is None or not ledger.follows(attempt.backend):
            return None
        prediction = Prediction(ledger, attempt.backend, self._stats)
        schedule_prediction(self._jobs, prediction, self._counter(attempt.backend), attempt.payload,
                            attempt.cache_salt, sent_at, asynchronous=asynchronous)
        return prediction

    def _check_warm_prefix(self, warmed: Payload, attempt: Attempt, asynchronous: bool) -> None:
        """The broken-warm diagnostic, off the request path: a task (async) or a pool thread (sync)."""
        schedule_warm_prefix_check(self._jobs, self._counter(attempt.backend), warmed, attempt.payload, self._stats,
                                   self.session_id, asynchronous=asynchronous)

    def _next_action(self, attempt: Attempt, outcome: Outcome | None) -> Action:
        """What ``attempt``'s turn does next (:func:`~agentkv._session.decide.next_action` over this Session's state)."""
        return next_action(attempt.decision, outcome, handed_off=attempt.handed_off, handoff_active=self.handoff.active,
                           previous_role=self._record.previous_role, has_slow=self.slow is not None, retry=self.retry,
                           streamed=attempt.turn.streamed)

    def _handoff(self, attempt: Attempt) -> None:
        if self.slow is None:
            return
        attempt.handed_off = True
        previous = self._history[-2] if len(self._history) > 1 else None  # what fast last served: cheap to export
        outcome = self.handoff.at_escalation(self.fast, self.slow, attempt.payload, self.cache_salt, attempt=attempt,
                                             previous=previous, warm=self._warm, http=self.http)
        self._stats.add("mapped_tokens", outcome.mapped_tokens)
        self._stats.add("handoff_fallbacks", int(outcome.fallback))

    # ----------------------------------------------------------------- warm-ahead

    def _maybe_warm(self, attempt: Attempt, facts: Facts, asynchronous: bool) -> None:
        if self.slow is not None:
            attempt.warm = self._warm.consider(attempt.payload, **self._warm_inputs(attempt, facts))
            self._send_warm(attempt, asynchronous)

    async def _amaybe_warm(self, attempt: Attempt, facts: Facts) -> None:
        """The async twin of :meth:`_maybe_warm`: the shared store's claim is awaited."""
        if self.slow is not None:
            attempt.warm = await self._warm.aconsider(attempt.payload, **self._warm_inputs(attempt, facts))
            self._send_warm(attempt, asynchronous=True)

    def _warm_inputs(self, attempt: Attempt, facts: Facts) -> dict[str, Any]:
        boundary = None if facts.fast.window is None else facts.fast.window - self.routing.output_floor
        return dict(estimated_tokens=attempt.count.total, fast_window=facts.fast.window,
                    routed_role=attempt.decision.role, model_known=facts.slow_model_known,
                    enabled=_env.warm_ahead_enabled(), boundary_tokens=boundary)

    def _send_warm(self, attempt: Attempt, asynchronous: bool) -> None:
        if not self._warm.wants_send(attempt.warm) or self.slow is None:
            return
        text = attempt.text  # a text completion warms ``/completions`` with its prompt
        url = raw_warm_target(self.slow, text=text)
        try:
            if url is None and text:
                raise ValueError("a text completion is warmed only by a raw POST to a self-hosted slow backend")
            if url is not None:  # a raw POST: the same bytes as the request, no litellm import on the way
                body = warm_body(self.slow, attempt.kwargs, self.cache_salt, raw=attempt.raw,
                                 keep_caller_salt=attempt.keeps_caller_salt)
                (self._warm.apost if asynchronous else self._warm.post)(url, body, self.http)
                return
            call = warm_kwargs(self.slow, attempt.kwargs, self.cache_salt, self.warm_ahead.timeout_s,
                               keep_caller_salt=attempt.keeps_caller_salt)
        except Exception as exc:  # building a warm never raises into the caller
            self._warm.abandon(exc)
            return
        (self._warm.asend if asynchronous else self._warm.send)(call, self.client)
