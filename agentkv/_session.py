"""The Session: routes each request of an agent's loop between a fast and a slow backend.

``Session.completion`` and ``Session.acompletion`` are thin drivers over shared planning steps: count
the payload (:mod:`agentkv.tokens`), decide the route (:func:`agentkv.routing.decide_route`), maybe
fire a warm-ahead (:mod:`agentkv.warm`), send through litellm with transient retries, and on a
context overflow plan a recovery (:func:`agentkv.routing.plan_recovery`).

    with Session(fast=fast, slow=slow, tenant="acme", session_id="chat-42") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)
        s.last_route, s.stats()
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

from agentkv import _env
from agentkv.backends import Backend, WindowDiscovery, catalog_window, default_discovery
from agentkv.errors import ConfigurationError, ContextOverflowError
from agentkv.events import emit, prompt_fields
from agentkv.overflow import Overflow, overflow_from_error
from agentkv.prefix import PrefixReport, build_report, explain_divergence
from agentkv.retry import RetryPolicy
from agentkv.routing import (
    RouteDecision, RoutePolicy, Target, check_fits_slow, decide_route, plan_recovery, slow_budget,
)
from agentkv.session_handoff import Handoff
from agentkv.session_parts import Attempt, Observation, warm_kwargs
from agentkv.session_record import Recorder
from agentkv.stats import LedgerEntry, SessionStats
from agentkv.tenancy import derive_cache_salt
from agentkv.tokens import Payload, TokenCount, TokenCounter, payload_from_request
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy, shared_cooldowns, shared_in_flight
from agentkv.warm_ahead import WarmAhead


class Session:
    """A fast/slow routing session for one conversation of one tenant.

    ``fast`` answers while the conversation fits its window; ``slow`` takes what it cannot hold.
    ``client`` is anything with litellm's ``completion``/``acompletion`` (litellm itself by default);
    ``discovery``, ``cooldowns`` and ``in_flight`` default to process-wide shared instances.
    ``cache_salt`` is sent as ``extra_body.cache_salt`` to self-hosted backends; when it is not given
    and the Session has a tenant, it is derived as HMAC(``cache_salt_secret``, tenant) (the secret
    defaulting to ``AGENTKV_CACHE_SALT_SECRET``).
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
        cache_salt: str | None = None,
        cache_salt_secret: str | None = None,
        client: Any = None,
        count_with_server: bool = True,
        handoff: str | Handoff = "replay",
        mapper: Any = None,
        min_attention_cosine: float | None = None,
    ) -> None:
        _check_backends(fast, slow)
        self.fast, self.slow = fast, slow
        self.tenant = tenant
        self.session_id = session_id or str(uuid.uuid4())
        self.routing, self.warm_ahead, self.retry = routing, warm_ahead, retry
        self.discovery = discovery or default_discovery()
        self.cache_salt = cache_salt or _derive_salt(tenant, cache_salt_secret)
        self._client = client
        self.counters = {b.label: TokenCounter.for_backend(b, use_server=count_with_server) for b in (fast, slow) if b}
        self.handoff = handoff if isinstance(handoff, Handoff) else Handoff(
            handoff, mapper, min_attention_cosine=min_attention_cosine)
        self._stats = SessionStats()
        self.last_route: RouteDecision | None = None
        self._history: list[Payload] = []
        cooldowns = cooldowns or shared_cooldowns(warm_ahead.max_sessions, warm_ahead.cooldown_s)
        self._warm = WarmAhead(warm_ahead, cooldowns.for_tenant(tenant),
                               in_flight or shared_in_flight(warm_ahead.max_in_flight), self._stats, lambda: self.client,
                               session_id=self.session_id, tenant=tenant)
        self._record = Recorder(self._stats, lambda: self._warm.warmed, self._report, self.session_id)
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

    # ----------------------------------------------------------------- public API
    @property
    def client(self) -> Any:
        """The litellm-compatible client (litellm itself, imported on first use)."""
        if self._client is None:
            self._client = _env.import_litellm()
        return self._client

    def completion(self, **kwargs: Any) -> Any:
        """Route and send a chat completion; litellm kwargs pass through; returns litellm's response."""
        payload = self._open_request(kwargs)
        attempt = self._plan(kwargs, payload, self.counters[self.fast.label].count(payload))
        self._maybe_warm(attempt, kwargs, asynchronous=False)
        while True:
            self._handoff(attempt)
            call = attempt.call_kwargs
            try:
                response = self.retry.call(lambda: self.client.completion(**call))
            except Exception as error:
                overflow = _overflow_or_reraise(error)
                attempt = self._recover(attempt, error, overflow, self._recount(attempt))
                continue
            return self._record.finish(attempt, response)

    async def acompletion(self, **kwargs: Any) -> Any:
        """The async twin of :meth:`completion`."""
        payload = self._open_request(kwargs)
        await self._aprefetch()
        attempt = self._plan(kwargs, payload, await self.counters[self.fast.label].acount(payload))
        self._maybe_warm(attempt, kwargs, asynchronous=True)
        while True:
            if self._needs_handoff(attempt):
                await asyncio.to_thread(self._handoff, attempt)  # torch work, off the event loop
            call = attempt.call_kwargs
            try:
                response = await self.retry.acall(lambda: self.client.acompletion(**call))
            except Exception as error:
                overflow = _overflow_or_reraise(error)
                attempt = self._recover(attempt, error, overflow, await self._arecount(attempt))
                continue
            return self._record.finish(attempt, response)

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
        payload = self._open_request(kwargs)
        count = self.counters[self.fast.label].count(payload)
        return self._observed(kwargs, payload, count, sent_to=sent_to, asynchronous=False)

    async def aobserve(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """The async twin of :meth:`observe` (warms run as tasks)."""
        payload = self._open_request(kwargs)
        await self._aprefetch()
        count = await self.counters[self.fast.label].acount(payload)
        return self._observed(kwargs, payload, count, sent_to=sent_to, asynchronous=True)

    def record_usage(self, turn: int, *, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to an observed ledger turn."""
        self._record.record_usage(turn, cached_tokens)

    @property
    def ledger(self) -> list[LedgerEntry]:
        """One row per request: tokens, the tool schemas' share, count source, route, warm-ahead, cached tokens."""
        return self._record.ledger

    def _observed(self, kwargs: dict[str, Any], payload: Payload, count: TokenCount, *, sent_to: str,
                  asynchronous: bool) -> Observation:
        if sent_to not in ("fast", "slow") or (sent_to == "slow" and self.slow is None):
            raise ValueError(f"sent_to must be 'fast' or 'slow' (with a slow backend), got {sent_to!r}")
        fast, slow = self._targets()
        try:
            decision: RouteDecision | None = self._decide(kwargs, count)
        except ContextOverflowError:
            decision = None
        target = fast if sent_to == "fast" else slow
        as_sent = RouteDecision(target.name, sent_to, "fits", count.total, target.window, _max_tokens(kwargs),  # type: ignore[arg-type]
                                count.source)
        attempt = Attempt(as_sent, self._backend(sent_to), kwargs, payload, count, self.cache_salt)
        self._maybe_warm(attempt, kwargs, asynchronous)
        entry = self._record.observed(count, target.name, attempt.warm)
        return Observation(entry.turn, count, decision, fast.window, attempt.warm)

    def stats(self) -> dict[str, Any]:
        """Plain dict of counters: requests per backend, routes, clamps, fallbacks, warms, cached tokens."""
        return self._stats.snapshot()

    def route(self, **kwargs: Any) -> RouteDecision:
        """The route this Session would choose for a request, sending and recording nothing.

        Raises :class:`ContextOverflowError` when no backend can hold it.
        """
        return self._decide(kwargs, self.counters[self.fast.label].count(payload_from_request(kwargs)))

    async def aroute(self, **kwargs: Any) -> RouteDecision:
        """The async twin of :meth:`route`."""
        await self._aprefetch()
        return self._decide(kwargs, await self.counters[self.fast.label].acount(payload_from_request(kwargs)))

    def count(self, **kwargs: Any) -> TokenCount:
        """Count a request as the fast backend will receive it, without sending anything."""
        return self.counters[self.fast.label].count(payload_from_request(kwargs))

    def prefix_report(self) -> PrefixReport | None:
        """Compare the rendered token prefixes of the last two requests (None before the second)."""
        if len(self._history) < 2:
            return None
        return self._report(self._history[-2], self._history[-1])

    # ----------------------------------------------------------------- planning
    def _open_request(self, kwargs: dict[str, Any]) -> Payload:
        if self.closed:
            raise RuntimeError(f"Session {self.session_id!r} is closed")
        payload = payload_from_request(kwargs)
        if payload.messages is None:
            raise ValueError("Session.completion needs 'messages'; 'prompt' alone is a text completion")
        self._history = [*self._history[-1:], payload]
        return payload

    def _backends(self) -> list[Backend]:
        return [b for b in (self.fast, self.slow) if b is not None]

    async def _aprefetch(self) -> None:
        """Fill discovery over async HTTP, so the shared planning steps below only hit its cache."""
        for backend in self._backends():
            await self.discovery.aprefetch(backend)

    def _targets(self) -> tuple[Target, Target]:
        fast = Target(self.fast.label, self.discovery.window(self.fast).window)
        if self.slow is None:
            return fast, Target("(none)", None, usable=False, why_unusable="no slow backend configured")
        slow = Target(self.slow.label, self.discovery.window(self.slow).window)
        if self.slow.is_cloud and catalog_window(self.slow.model) is None:
            why = f"cloud model {self.slow.model!r} is not in litellm's catalog"
            slow = replace(slow, usable=False, why_unusable=why)
        return fast, slow

    def _decide(self, kwargs: dict[str, Any], count: TokenCount) -> RouteDecision:
        fast, slow = self._targets()
        return decide_route(route_tokens=count.total, safe_tokens=count.safe, max_tokens=_max_tokens(kwargs),
                            fast=fast, slow=slow, policy=self.routing, count_source=count.source)

    def _plan(self, kwargs: dict[str, Any], payload: Payload, count: TokenCount) -> Attempt:
        try:
            decision = self._decide(kwargs, count)
        except ContextOverflowError:
            self._stats.add("slow_overflow_refusals")
            raise
        if decision.note:
            self._stats.add("catalog_refusals")
        self._log_route(decision, count)
        return Attempt(decision, self._backend(decision.role), kwargs, payload, count, self.cache_salt)

    def _backend(self, role: str) -> Backend:
        return self.slow if role == "slow" and self.slow is not None else self.fast

    def _log_route(self, decision: RouteDecision, count: TokenCount) -> None:
        self.last_route = decision
        emit(
            "route", reason=decision.reason, target=decision.backend, role=decision.role,
            estimate=decision.estimated_input_tokens, floor=self.routing.output_floor, window=decision.window,
            max_tokens=decision.max_tokens, count_source=count.source, exact=count.exact,
            tool_tokens=count.tools, session=self.session_id, tenant=self.tenant, note=decision.note or None,
            **prompt_fields(self._history[-1] if self._history else None),
        )

    # ----------------------------------------------------------------- the reactive path
    def _recover(self, attempt: Attempt, error: Exception, overflow: Overflow, count: TokenCount) -> Attempt:
        """``count``: the failed backend's own count of the request (exact where it can be)."""
        self._stats.add("overflow_errors")
        window = self.discovery.window(attempt.backend).window
        if overflow.max_context and overflow.max_context != window:
            self.discovery.correct(attempt.backend, overflow.max_context)
        _, slow = self._targets()
        plan = plan_recovery(
            overflow, role=attempt.decision.role, exact_prompt_tokens=count.total if count.exact else None,
            requested_max_tokens=attempt.decision.max_tokens, known_window=window, safe_prompt_tokens=count.safe,
            already_clamped=attempt.reactive_clamped, slow_usable=slow.usable and attempt.decision.role == "fast",
            policy=self.routing,
        )
        emit("overflow", level="warning", variant=overflow.variant, action=plan.action, why=plan.why,
             backend=attempt.backend.label, server_window=overflow.max_context, prompt=plan.prompt_tokens)
        if plan.action == "give_up":
            raise ContextOverflowError(
                f"{attempt.backend.label!r} rejected the request as too long and no backend can take it: {plan.why}",
                input_tokens=plan.prompt_tokens or attempt.count.total,
                windows={attempt.backend.label: overflow.max_context or window}, max_tokens=attempt.decision.max_tokens,
            ) from error
        return self._next_attempt(attempt, plan.action, plan.max_tokens, plan.prompt_tokens, slow)

    def _next_attempt(self, attempt: Attempt, action: str, max_tokens: int | None, prompt: int | None,
                      slow: Target) -> Attempt:
        self._stats.add("reactive_fallbacks")
        estimate = prompt if prompt is not None else attempt.decision.estimated_input_tokens
        if action == "clamp":
            decision = replace(attempt.decision, reason="reactive_clamp", max_tokens=max_tokens,
                               estimated_input_tokens=estimate)
            self._log_route(decision, attempt.count)
            return replace(attempt, decision=decision, reactive_clamped=True)
        fast_target, _ = self._targets()
        check_fits_slow(estimate, fast_target, slow, self.routing, _max_tokens(attempt.kwargs))
        budget = slow_budget(_max_tokens(attempt.kwargs), max(attempt.count.safe, estimate), estimate, slow.window)
        decision = RouteDecision(slow.name, "slow", "reactive_escalate", estimate, slow.window, budget,
                                 attempt.count.source)
        self._log_route(decision, attempt.count)
        return replace(attempt, decision=decision, backend=self._backend("slow"), reactive_clamped=False)

    def _recount(self, attempt: Attempt) -> TokenCount:
        """The failed backend's count of the request: fast's exact count is reused, others are asked."""
        if attempt.count.exact and attempt.backend is self.fast:
            return attempt.count
        return self.counters[attempt.backend.label].count(attempt.payload)

    async def _arecount(self, attempt: Attempt) -> TokenCount:
        if attempt.count.exact and attempt.backend is self.fast:
            return attempt.count
        return await self.counters[attempt.backend.label].acount(attempt.payload)

    def _report(self, previous: Payload, current: Payload, counter_label: str | None = None) -> PrefixReport:
        counter = self.counters[counter_label or self.fast.label]
        prev_ids, exact = counter.token_ids(previous, add_generation_prompt=False)
        ids, exact_now = counter.token_ids(current)
        divergence = explain_divergence(previous.messages or (), previous.tools, current.messages or (), current.tools)
        return build_report(prev_ids, ids, divergence, exact=exact and exact_now)

    # ----------------------------------------------------------------- handoff at escalation
    def _needs_handoff(self, attempt: Attempt) -> bool:
        return self.handoff.active and not attempt.handed_off and self._record.is_escalation(attempt.decision)

    def _handoff(self, attempt: Attempt) -> None:
        if not self._needs_handoff(attempt) or self.slow is None:
            return
        attempt.handed_off = True
        outcome = self.handoff.at_escalation(self.fast, self.slow, attempt.payload, self.cache_salt)
        self._stats.add("mapped_tokens", outcome.mapped_tokens)
        self._stats.add("handoff_fallbacks", int(outcome.fallback))

    # ----------------------------------------------------------------- warm-ahead
    def _maybe_warm(self, attempt: Attempt, kwargs: dict[str, Any], asynchronous: bool) -> None:
        if self.slow is None:
            return
        attempt.warm = self._warm.consider(
            attempt.payload, estimated_tokens=attempt.count.total, fast_window=self.discovery.window(self.fast).window,
            routed_role=attempt.decision.role, model_known=self.discovery.served_model_known(self.slow),
        )
        if attempt.warm == "fire":
            self._warm.fire(lambda: warm_kwargs(self.slow, kwargs, self.cache_salt, self.warm_ahead.timeout_s),
                            asynchronous=asynchronous)

    def drain_warms(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` for this Session's threaded warms; True when none is left in flight.

        For tests, benchmarks and demos: requests never wait for warms.
        """
        return self._warm.drain(timeout_s)

    async def adrain_warms(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for this Session's async warm tasks (tests, benchmarks, demos)."""
        await self._warm.adrain(timeout_s)


def _overflow_or_reraise(error: Exception) -> Overflow:
    """The overflow an error reports; any other error propagates untouched."""
    overflow = overflow_from_error(error)
    if overflow is None:
        raise error
    return overflow


def _max_tokens(kwargs: dict[str, Any]) -> int | None:
    """The output budget the server will obey: ``max_completion_tokens``, else ``max_tokens`` (as vLLM)."""
    value = kwargs.get("max_completion_tokens")
    value = kwargs.get("max_tokens") if value is None else value
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_tokens must be a positive int, got {value!r}")
    return value


def _check_backends(fast: Any, slow: Any) -> None:
    if not isinstance(fast, Backend):
        raise ConfigurationError(f"Session(fast=...) must be a Backend, got {type(fast).__name__}")
    if slow is not None and not isinstance(slow, Backend):
        raise ConfigurationError(f"Session(slow=...) must be a Backend or None, got {type(slow).__name__}")
    if slow is not None and slow.label == fast.label:
        raise ConfigurationError(f"fast and slow backends need distinct names; both are {fast.label!r}")


def _derive_salt(tenant: str | None, secret: str | None) -> str | None:
    secret = secret or _env.cache_salt_secret()
    return derive_cache_salt(secret, tenant) if tenant and secret else None
