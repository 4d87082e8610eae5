"""The Session: routes each request of an agent's loop between a fast and a slow backend.

``Session.completion`` and ``Session.acompletion`` are twin drivers, each read like tenacity's
``Retrying.__call__``: gather the inputs that need I/O (windows and served models through
:class:`~agentkv.discovery.WindowDiscovery`, the count through :class:`~agentkv.tokens.TokenCounter`;
the async driver awaits every one), ask the pure core for a decision (:mod:`agentkv.routing`,
:mod:`agentkv.warm.policy`), send, and on a context overflow ask the core for the next try.

    with Session(fast=fast, slow=slow, tenant="acme", session_id="chat-42") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)
        s.last_route, s.stats()
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

import agentkv._env as _env
from agentkv._http import HttpTransport, default_http
from agentkv._session.attempts import (
    Attempt, LitellmSends, Observation, raw_warm_target, warm_body, warm_kwargs,
)
from agentkv._session.escalation import Handoff, prefix_report, schedule_warm_prefix_check
from agentkv._session.inputs import Facts, check_backends, check_timeout, max_tokens_of, to_facts
from agentkv._session.prediction import Prediction, schedule_prediction
from agentkv._session.record import Recorder
from agentkv.backends import Backend
from agentkv.discovery import WindowDiscovery, discovery_for
from agentkv.errors import ContextOverflowError
from agentkv.events import emit, enabled, prompt_fields
from agentkv.overflow import Overflow, overflow_from_error
from agentkv.prefix import PrefixReport
from agentkv.protocols import CompletionClient
from agentkv.retry import RetryPolicy, is_outage
from agentkv.routing import (
    RouteDecision, RoutePolicy, after_recovery, as_sent, decide_route, failover, interval_decides,
    is_escalation, plan_recovery,
)
from agentkv.stats import LedgerEntry, SessionStats
from agentkv.tenancy import resolve_cache_salt
from agentkv.tokens import Payload, TokenCount, TokenCounter, payload_from_request
from agentkv.tokens.payload import detached
from agentkv.state import StateStore
from agentkv.state.config import resolve_state
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy
from agentkv.warm.aware import SlowResidency
from agentkv.warm.sender import BackgroundJobs, WarmAhead

if TYPE_CHECKING:
    from agentkv.ledger import CacheLedger

DEFAULT_REQUEST_TIMEOUT_S = 600.0


class Session:
    """A fast/slow routing session for one conversation of one tenant.

    ``fast`` answers while the conversation fits its window; ``slow`` takes what it cannot hold.
    ``client`` is anything with litellm's ``completion``/``acompletion`` (litellm itself by default,
    imported on first use and never on an event loop);
    ``discovery``, ``cooldowns`` and ``in_flight`` default to process-wide shared instances; ``state``
    (a :class:`~agentkv.state.StateStore`, e.g. ``RedisStore.from_url(url)``; ``AGENTKV_REDIS_URL``
    when not given) shares the warm-ahead guards and discovered windows across replicas; ``http``
    is the HTTP seam the Session's own counters use (``/tokenize``). Counts are estimated locally and
    the exact source (``/tokenize``) asked only where a decision depends on the difference
    (:meth:`~agentkv.tokens.TokenCounter.count_for`); ``count_exactly=True`` asks it every time.
    ``cache_salt`` is sent as ``extra_body.cache_salt`` to self-hosted backends; when it is not given
    and the Session has a tenant, it is derived as HMAC(``cache_salt_secret``, tenant) (the secret
    defaulting to ``AGENTKV_CACHE_SALT_SECRET``). A tenant on a self-hosted backend with neither is
    refused (:class:`ConfigurationError`) unless ``cache_salt=False`` opts out of isolation knowingly.
    ``request_timeout_s`` bounds each attempt of a request (a call's own ``timeout=`` wins; None: the
    client's default, litellm's being 6,000 s).
    ``ledger`` (a started :class:`~agentkv.ledger.CacheLedger`): when it follows the slow backend, warm-ahead
    is event-aware (skips a resident prefix, re-warms an evicted one, tops up a growing tail; see
    ``docs/warm-ahead.md``), and every request to a backend it follows records the ledger's prediction
    against the ``cached_tokens`` reported (``ledger_predictions*`` in :meth:`stats`).
    """

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
                               tenant=tenant)
        self._record = Recorder(self._stats)
        self._sends = LitellmSends()  # the tools as litellm sends them, rebuilt when the caller's change
        self.cache_ledger = ledger
        if ledger is not None and slow is not None and ledger.follows(slow):
            self._warm.attach(SlowResidency(ledger, slow, self.cache_salt, self._counter(slow)))
        self.closed = False

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def close(self) -> None:
        """Stop accepting requests. In-flight warms are left to finish or time out; nothing waits."""
        self.closed = True

    async def aclose(self) -> None:
        """Async close. In-flight warm tasks run on, bounded by their timeout: a warm fired on the last
        turn of a call is exactly the one the next call wants."""
        self.close()

    # ----------------------------------------------------------------- the drivers
    def completion(self, **kwargs: Any) -> Any:
        """Route and send a chat completion; litellm kwargs pass through; returns litellm's response."""
        kwargs = dict(self._sends(self.fast.model, kwargs))
        payload = self._open_request(kwargs)
        facts = self._facts()
        attempt = self._plan(kwargs, payload, self._count(kwargs, payload, facts), facts)
        self._maybe_warm(attempt, facts, asynchronous=False)
        while True:
            if self._needs_handoff(attempt):
                self._handoff(attempt)
            call = attempt.call_kwargs
            try:
                response = self.retry.call(functools.partial(self.client.completion, **call))
            except Exception as error:
                overflow = overflow_from_error(error)
                if overflow is None:
                    attempt = self._fail_over(attempt, error, facts)
                    continue
                attempt = self._recover(attempt, error, overflow, self._recount(attempt), self._facts())
                continue
            return self._finish(attempt, response, asynchronous=False)

    async def acompletion(self, **kwargs: Any) -> Any:
        """The async twin of :meth:`completion`: every input is awaited, nothing blocks the event loop."""
        kwargs = dict(self._sends(self.fast.model, kwargs))
        payload = self._open_request(kwargs)
        facts = await self._afacts()
        attempt = self._plan(kwargs, payload, await self._acount(kwargs, payload, facts), facts)
        await self._amaybe_warm(attempt, facts)
        while True:
            if self._needs_handoff(attempt):
                await asyncio.to_thread(self._handoff, attempt)  # torch work, off the event loop
            call = attempt.call_kwargs
            try:
                response = await self.retry.acall(functools.partial(self.client.acompletion, **call))
            except Exception as error:
                overflow = overflow_from_error(error)
                if overflow is None:
                    attempt = self._fail_over(attempt, error, facts)
                    continue
                attempt = self._recover(attempt, error, overflow, await self._arecount(attempt), await self._afacts())
                continue
            return self._finish(attempt, response, asynchronous=True)

    def run(self, user_message: Any, tools: Any = None, *, max_steps: int = 20, **kwargs: Any) -> Any:
        """Run a ReAct loop through this Session's routing (see :func:`agentkv.react.run_loop`)."""
        from agentkv.react import run_loop

        return run_loop(self, user_message, tools, max_steps=max_steps, **kwargs)

    async def arun(self, user_message: Any, tools: Any = None, *, max_steps: int = 20, **kwargs: Any) -> Any:
        """The async twin of :meth:`run` (see :func:`agentkv.react.arun_loop`)."""
        from agentkv.react import arun_loop

        return await arun_loop(self, user_message, tools, max_steps=max_steps, **kwargs)

    def observe(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """Account a request sent outside the Session (a LangChain callback, a litellm logger).

        The request is counted and recorded in the ledger (as sent to ``sent_to``, "fast" or "slow"),
        and warm-ahead fires when due; nothing else is sent. The returned :class:`Observation` says
        whether fast can take the request as it is.
        """
        role = self._sent_to(sent_to)
        payload = self._open_request(kwargs)
        facts = self._facts()
        attempt, decision = self._observed(kwargs, payload, self._count(kwargs, payload, facts), facts, role)
        self._maybe_warm(attempt, facts, asynchronous=False)
        return self._observation(attempt, decision, facts)

    async def aobserve(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """The async twin of :meth:`observe` (warms run as tasks)."""
        role = self._sent_to(sent_to)
        payload = self._open_request(kwargs)
        facts = await self._afacts()
        attempt, decision = self._observed(kwargs, payload, await self._acount(kwargs, payload, facts), facts, role)
        await self._amaybe_warm(attempt, facts)
        return self._observation(attempt, decision, facts)

    def prepare(self, body: Mapping[str, Any]) -> Attempt:
        """Count, route and clamp a raw OpenAI request ``body`` its caller sends itself, and warm when due.

        For senders outside litellm (the httpx transport, the LangChain router): the returned
        :class:`Attempt` says where it goes (``decision``, ``backend``) and with which output budget;
        a warm repeats ``body`` itself with a one-token budget. Hand an overflow to :meth:`recover` and
        the answer to :meth:`answered`.
        """
        payload = self._open_request(dict(body))
        facts = self._facts()
        attempt = self._prepared(body, payload, self._count(body, payload, facts), facts)
        self._maybe_warm(attempt, facts, asynchronous=False)
        return attempt

    async def aprepare(self, body: Mapping[str, Any]) -> Attempt:
        """The async twin of :meth:`prepare` (the count is awaited; a warm runs as a task)."""
        payload = self._open_request(dict(body))
        facts = await self._afacts()
        attempt = self._prepared(body, payload, await self._acount(body, payload, facts), facts)
        await self._amaybe_warm(attempt, facts)
        return attempt

    def recover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The next try after ``attempt`` failed with ``error``: a recoverable overflow is clamped or escalated,
        an outage fails over when the other backend can take it; anything else is re-raised."""
        overflow = overflow_from_error(error)
        if overflow is None:
            return self._fail_over(attempt, error, self._facts())
        return self._recover(attempt, error, overflow, self._recount(attempt), self._facts())

    async def arecover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The async twin of :meth:`recover`."""
        overflow = overflow_from_error(error)
        if overflow is None:
            return self._fail_over(attempt, error, await self._afacts())
        return self._recover(attempt, error, overflow, await self._arecount(attempt), await self._afacts())

    def answered(self, attempt: Attempt, response: Any, *, asynchronous: bool = False) -> Any:
        """Record ``attempt`` as answered with ``response`` (a dict or object with OpenAI's ``usage``):
        requests per backend, the ledger row, the escalation and its cached tokens, as :meth:`completion`."""
        return self._finish(attempt, response, asynchronous=asynchronous)

    def _prepared(self, body: Mapping[str, Any], payload: Payload, count: TokenCount, facts: Facts) -> Attempt:
        return replace(self._plan(dict(body), payload, count, facts), raw=True)

    def route(self, **kwargs: Any) -> RouteDecision:
        """The route this Session would choose for a request, sending and recording nothing.

        Raises :class:`ContextOverflowError` when no backend can hold it.
        """
        payload, facts = payload_from_request(kwargs), self._facts()
        return self._decide(kwargs, self._count(kwargs, payload, facts), facts)

    async def aroute(self, **kwargs: Any) -> RouteDecision:
        """The async twin of :meth:`route`."""
        payload, facts = payload_from_request(kwargs), await self._afacts()
        return self._decide(kwargs, await self._acount(kwargs, payload, facts), facts)

    def count(self, **kwargs: Any) -> TokenCount:
        """Count a request as the fast backend will receive it, without sending anything."""
        return self._counter(self.fast).count(payload_from_request(kwargs))

    def record_usage(self, turn: int, *, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to an observed ledger turn."""
        self._record.record_usage(turn, cached_tokens)

    @property
    def ledger(self) -> list[LedgerEntry]:
        """One row per request: tokens, the tool schemas' share, count source, route, warm-ahead, cached tokens."""
        return self._record.ledger

    def stats(self) -> dict[str, Any]:
        """Plain dict of counters: requests per backend, routes, clamps, fallbacks, warms, cached tokens."""
        return self._stats.snapshot()

    def prefix_report(self) -> PrefixReport | None:
        """Compare the rendered token prefixes of the last two requests (None before the second)."""
        if len(self._history) < 2:
            return None
        previous, current = self._history[-2:]
        counter = self._counter(self.fast)
        return prefix_report(previous, current, counter.token_ids(previous, add_generation_prompt=False),
                             counter.token_ids(current))

    async def aprefix_report(self) -> PrefixReport | None:
        """The async twin of :meth:`prefix_report`."""
        if len(self._history) < 2:
            return None
        previous, current = self._history[-2:]
        counter = self._counter(self.fast)
        return prefix_report(previous, current, await counter.atoken_ids(previous, add_generation_prompt=False),
                             await counter.atoken_ids(current))

    def drain_warms(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` for this Session's background work on threads (warms, diagnostics);
        True when none is left. For tests, benchmarks and demos: requests never wait for it."""
        return self._jobs.drain(timeout_s)

    async def adrain_warms(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for this Session's background tasks (tests, benchmarks, demos)."""
        await self._jobs.adrain(timeout_s)

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
        """The failed backend's count of the request: fast's exact count is reused, others are asked."""
        if attempt.count.exact and attempt.backend is self.fast:
            return attempt.count
        return self._counter(attempt.backend).count(attempt.payload)

    async def _arecount(self, attempt: Attempt) -> TokenCount:
        if attempt.count.exact and attempt.backend is self.fast:
            return attempt.count
        return await self._counter(attempt.backend).acount(attempt.payload)

    # ----------------------------------------------------------------- planning (no I/O below here)
    def _open_request(self, kwargs: dict[str, Any]) -> Payload:
        if self.closed:
            raise RuntimeError(f"Session {self.session_id!r} is closed")
        max_tokens_of(kwargs)  # a bad budget is refused before any count or network call
        payload = payload_from_request(kwargs)
        if payload.messages is None:
            raise ValueError("Session.completion needs 'messages'; 'prompt' alone is a text completion")
        self._history = [*self._history[-1:], detached(payload)]  # as sent, whatever the caller edits later
        return payload

    def _backends(self) -> list[Backend]:
        return [b for b in (self.fast, self.slow) if b is not None]

    def _backend(self, role: str) -> Backend:
        return self.slow if role == "slow" and self.slow is not None else self.fast

    def _sent_to(self, sent_to: str) -> Literal["fast", "slow"]:
        if sent_to == "fast" or (sent_to == "slow" and self.slow is not None):
            return "slow" if sent_to == "slow" else "fast"
        raise ValueError(f"sent_to must be 'fast' or 'slow' (with a slow backend), got {sent_to!r}")

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
                       timeout_s=self.request_timeout_s, sent_at=self._stamp())

    def _stamp(self) -> float | None:
        """The publishers' clock now (vLLM stamps event batches with ``time.time()``; the prediction reads the ledger
        as of it, whatever clock the ledger was given); None without a ledger."""
        return time.time() if self.cache_ledger is not None else None

    def _observed(self, kwargs: dict[str, Any], payload: Payload, count: TokenCount, facts: Facts,
                  role: Literal["fast", "slow"]) -> tuple[Attempt, RouteDecision | None]:
        try:
            decision: RouteDecision | None = self._decide(kwargs, count, facts)
        except ContextOverflowError:
            decision = None
        target = facts.fast if role == "fast" else facts.slow
        sent = as_sent(target, role, input_tokens=count.total, max_tokens=max_tokens_of(kwargs), count_source=count.source)
        return Attempt(sent, self._backend(role), kwargs, payload, count, self.cache_salt), decision

    def _observation(self, attempt: Attempt, decision: RouteDecision | None, facts: Facts) -> Observation:
        target = facts.fast if attempt.decision.role == "fast" else facts.slow
        entry = self._record.observed(attempt.count, target.name, attempt.warm)
        return Observation(entry.turn, attempt.count, decision, facts.fast.window, attempt.warm, facts.slow.window)

    def _log_route(self, decision: RouteDecision, count: TokenCount) -> None:
        self.last_route = decision
        emit(
            "route", reason=decision.reason, target=decision.backend, role=decision.role,
            estimate=decision.estimated_input_tokens, floor=self.routing.output_floor, window=decision.window,
            max_tokens=decision.max_tokens, count_source=count.source, exact=count.exact,
            tool_tokens=count.tools, session=self.session_id, tenant=self.tenant, note=decision.note or None,
            **(prompt_fields(self._history[-1] if self._history else None) if enabled("info") else {}),
        )

    # ----------------------------------------------------------------- the reactive path
    def _recover(self, attempt: Attempt, error: Exception, overflow: Overflow, count: TokenCount,
                 facts: Facts) -> Attempt:
        """``count``: the failed backend's own count of the request (exact where it can be)."""
        self._stats.add("overflow_errors")
        failed = facts.fast if attempt.decision.role == "fast" else facts.slow
        if overflow.max_context:
            self.discovery.correct(attempt.backend, overflow.max_context)
        plan = plan_recovery(
            overflow, role=attempt.decision.role, exact_prompt_tokens=count.total if count.exact else None,
            requested_max_tokens=attempt.decision.max_tokens, known_window=failed.window, safe_prompt_tokens=count.safe,
            already_clamped=attempt.reactive_clamped,
            slow_usable=facts.slow.usable and attempt.decision.role == "fast", policy=self.routing,
        )
        emit("overflow", level="warning", variant=overflow.variant, action=plan.action, why=plan.why,
             backend=attempt.backend.label, server_window=overflow.max_context, prompt=plan.prompt_tokens)
        if plan.action == "give_up":
            windows = {facts.fast.name: facts.fast.window}
            if self.slow is not None:
                windows[facts.slow.name] = facts.slow.window
            windows[failed.name] = overflow.max_context or failed.window
            raise ContextOverflowError(
                f"{attempt.backend.label!r} rejected the request as too long and no backend can take it: {plan.why}",
                input_tokens=plan.prompt_tokens or attempt.count.total, windows=windows,
                max_tokens=attempt.decision.max_tokens,
            ) from error
        self._stats.add("reactive_fallbacks")
        fast = replace(facts.fast, window=overflow.max_context or facts.fast.window) \
            if attempt.decision.role == "fast" else facts.fast
        decision = after_recovery(attempt.decision, plan, fast=fast, slow=facts.slow, policy=self.routing,
                                  requested_max_tokens=max_tokens_of(attempt.kwargs), safe_tokens=attempt.count.safe)
        self._log_route(decision, attempt.count)
        escalated = decision.role != attempt.decision.role
        return replace(attempt, decision=decision, backend=self._backend(decision.role),
                       reactive_clamped=not escalated)

    def _fail_over(self, attempt: Attempt, error: Exception, facts: Facts) -> Attempt:
        """The next try when ``attempt``'s backend is down and the other one can take the request; any
        other error (or a second outage) propagates untouched."""
        if attempt.failed_over or self.slow is None or not is_outage(error):
            raise error
        decision = failover(attempt.decision, fast=facts.fast, slow=facts.slow, policy=self.routing,
                            route_tokens=attempt.count.total, safe_tokens=attempt.count.safe,
                            max_tokens=max_tokens_of(attempt.kwargs))
        if decision is None:
            raise error
        self._stats.add("failovers")
        emit("failover", level="warning", error=type(error).__name__, status_code=getattr(error, "status_code", None),
             failed=attempt.backend.label, to=decision.backend, session=self.session_id, tenant=self.tenant)
        self._log_route(decision, attempt.count)
        return replace(attempt, decision=decision, backend=self._backend(decision.role), failed_over=True,
                       reactive_clamped=False)

    # ----------------------------------------------------------------- at and after the answer
    def _finish(self, attempt: Attempt, response: Any, *, asynchronous: bool) -> Any:
        escalation = is_escalation(self._record.previous_role, attempt.decision)
        warmed = self._warm.warmed
        prediction = self._predict(attempt, asynchronous)
        result = self._record.finish(attempt, response, escalation=escalation, after_warm=warmed is not None,
                                     on_cached=prediction.reported if prediction is not None else None)
        if escalation and warmed is not None:
            self._check_warm_prefix(warmed, attempt, asynchronous)
        return result

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

    def _needs_handoff(self, attempt: Attempt) -> bool:
        return self.handoff.active and not attempt.handed_off \
            and is_escalation(self._record.previous_role, attempt.decision)

    def _handoff(self, attempt: Attempt) -> None:
        if self.slow is None:
            return
        attempt.handed_off = True
        outcome = self.handoff.at_escalation(self.fast, self.slow, attempt.payload, self.cache_salt)
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
        return dict(estimated_tokens=attempt.count.total, fast_window=facts.fast.window,
                    routed_role=attempt.decision.role, model_known=facts.slow_model_known,
                    enabled=_env.warm_ahead_enabled())

    def _send_warm(self, attempt: Attempt, asynchronous: bool) -> None:
        if not self._warm.wants_send(attempt.warm) or self.slow is None:
            return
        url = raw_warm_target(self.slow)
        try:
            if url is not None:  # a raw POST: the same bytes as the request, no litellm import on the way
                body = warm_body(self.slow, attempt.kwargs, self.cache_salt, raw=attempt.raw)
                (self._warm.apost if asynchronous else self._warm.post)(url, body, self.http)
                return
            call = warm_kwargs(self.slow, attempt.kwargs, self.cache_salt, self.warm_ahead.timeout_s)
        except Exception as exc:  # building a warm never raises into the caller
            self._warm.abandon(exc)
            return
        (self._warm.asend if asynchronous else self._warm.send)(call, self.client)
