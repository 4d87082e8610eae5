"""What one request goes through, as functions over a :class:`~agentkv._session.state.SessionState`: gathering its
inputs (the only I/O: window facts and counts), opening and planning it (the pure core decides), warm-ahead, the
handoff at the escalation, and what happens at its answer. The drivers (:mod:`agentkv._session.driver`,
:mod:`agentkv._session.drive`) call these in order; none of them loops or retries.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable, Mapping

import agentkv._env as _env
from agentkv._session import hosted
from agentkv._session.attempts import Attempt, raw_warm_target, warm_body, warm_kwargs
from agentkv._session.decide import Action, Outcome, next_action
from agentkv._session.inputs import Facts, max_tokens_of, request_payload, to_facts
from agentkv._session.prediction import Prediction, schedule_prediction
from agentkv._session.state import SessionState
from agentkv.backends import Backend, WindowInfo
from agentkv.costs import account
from agentkv._session.warm_prefix import schedule_warm_prefix_check
from agentkv.errors import ContextOverflowError
from agentkv.events import emit, enabled, prompt_fields
from agentkv.fleet import HOME_IDLE_S, HOME_SLACK, affinity_missed, pool_window, routing_headers
from agentkv.fleet.breaker import Evidence
from agentkv.retry import outage_cause, replica_evidence, replica_state
from agentkv.state import StateUnavailable
from agentkv.telemetry import turns
from agentkv.telemetry.otel import ended
from agentkv.routing import RouteDecision, decide_route, interval_decides, is_escalation
from agentkv.tenancy import screen_caller_salts
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.payload import detached
from agentkv.wire.hosted import explicit_cache_moves
from agentkv.wire.usage import Usage, server_clamped

__all__ = ["acount", "aeject", "afacts", "amaybe_warm", "arecount", "count", "decide", "decides", "eject", "facts",
           "finish", "hand_off", "log_route", "maybe_warm", "next_step", "open_request", "plan", "recount"]


# ----------------------------------------------------------------- gathering inputs (the only I/O)

def facts(s: SessionState) -> Facts:
    """The backends' windows and served models, as discovered now (cached, single flight; a pool's per replica,
    the smallest used), and which pooled replicas are cooling off."""
    down = s.ejections.down(s.pooled, s.tenant) if s.pooled else frozenset()
    if down:
        _probe_probation(s, asynchronous=False)
    fast = _pooled(s, s.fast, [s.discovery.window(b, model_known=False) for b in s._members(s.fast, down)])
    slow = None if s.slow is None else _pooled(s, s.slow, [s.discovery.window(b) for b in s._members(s.slow, down)])
    if not s.pooled:
        return to_facts(s.fast, s.slow, fast, slow)
    homes = {}
    for b in _pools(s):
        try:
            homes[b.label] = s.state.home_replica(*_home_ask(s, b), down, slack=HOME_SLACK, idle_s=HOME_IDLE_S,
                                                  tenant=s._tenant_digest or "")
        except StateUnavailable:  # no home known: the conversation's first choice (rendezvous alone)
            pass
    s.last_facts = to_facts(s.fast, s.slow, fast, slow, down, homes)
    return s.last_facts


async def afacts(s: SessionState) -> Facts:
    down = await s.ejections.adown(s.pooled, s.tenant) if s.pooled else frozenset()
    if down:
        _probe_probation(s, asynchronous=True)
    fast = _pooled(s, s.fast, [await s.discovery.awindow(b, model_known=False) for b in s._members(s.fast, down)])
    slow = None if s.slow is None else _pooled(
        s, s.slow, [await s.discovery.awindow(b) for b in s._members(s.slow, down)])
    if not s.pooled:
        return to_facts(s.fast, s.slow, fast, slow)
    homes = {}
    for b in _pools(s):
        try:
            homes[b.label] = await s.state.ahome_replica(*_home_ask(s, b), down, slack=HOME_SLACK, idle_s=HOME_IDLE_S,
                                                         tenant=s._tenant_digest or "")
        except StateUnavailable:
            pass
    s.last_facts = to_facts(s.fast, s.slow, fast, slow, down, homes)
    return s.last_facts


def _pools(s: SessionState) -> list[Backend]:
    return [b for b in s._backends() if b.is_pool]


def _home_ask(s: SessionState, pool: Backend) -> tuple[str, str, tuple[str, ...]]:
    """What the state store is asked for the conversation's home in ``pool``: the pool, the key, its ranking (with
    the tenant, whose share of the store's bound it counts against)."""
    return s.pool_ids[pool.label], s.routing_key, s.rankings[pool.label]


def _pooled(s: SessionState, backend: Backend, infos: list[WindowInfo]) -> WindowInfo:
    """One backend's window info: a pool's is its smallest replica's (a disagreement is warned of once)."""
    if len(infos) == 1 or all(info == infos[0] for info in infos):
        return infos[0]
    info, differing = pool_window(infos)
    if differing and (backend.label, differing) not in _WARNED:
        if len(_WARNED) < 1024:
            _WARNED.add((backend.label, differing))
        emit("pool_windows_differ", level="warning", backend=backend.label, windows=list(differing),
             used=info.window)
    return info


_WARNED: set[tuple[str, tuple[int, ...]]] = set()  # (pool, windows) warned of, once per process


def count(s: SessionState, kwargs: Mapping[str, Any], payload: Payload, known: Facts) -> TokenCount:
    """Fast's count: the local estimate, or the exact one where a decision depends on it."""
    return s._counter(s.fast).count_for(payload, decides(s, kwargs, known))


async def acount(s: SessionState, kwargs: Mapping[str, Any], payload: Payload, known: Facts) -> TokenCount:
    return await s._counter(s.fast).acount_for(payload, decides(s, kwargs, known))


def decides(s: SessionState, kwargs: Mapping[str, Any], known: Facts) -> Callable[[int, int], bool]:
    """Whether a count interval is enough for every decision this request meets (else it is counted exactly)."""
    warm = s.warm_ahead.threshold if s.slow is not None else None
    return functools.partial(interval_decides, max_tokens=max_tokens_of(kwargs), fast=known.fast, slow=known.slow,
                             policy=s.routing, warm_threshold=warm)


def recount(s: SessionState, attempt: Attempt) -> TokenCount:
    """The failed backend's count of the request: fast's exact count is reused, others are asked (and an
    exact answer teaches that backend's estimate bound)."""
    if attempt.count.exact and attempt.backend.label == s.fast.label:
        return attempt.count
    return _learned(s, attempt, s._counter(attempt.backend).count(attempt.payload))


async def arecount(s: SessionState, attempt: Attempt) -> TokenCount:
    if attempt.count.exact and attempt.backend.label == s.fast.label:
        return attempt.count
    return _learned(s, attempt, await s._counter(attempt.backend).acount(attempt.payload))


def _learned(s: SessionState, attempt: Attempt, counted: TokenCount) -> TokenCount:
    if counted.exact:
        s._counter(attempt.backend).learn(attempt.payload, counted.total, origin="recovery")
    return counted


# ----------------------------------------------------------------- opening and planning (no I/O below here)

def open_request(s: SessionState, kwargs: dict[str, Any], *, text: bool = False) -> Payload:
    """The request's payload, checked; ``text``: a prompt-only body (a text completion) is accepted too."""
    if s.closed:
        raise RuntimeError(f"Session {s.session_id!r} is closed")
    max_tokens_of(kwargs)  # a bad budget is refused before any count or network call
    screen_caller_salts(kwargs, s.cache_salt, keep=s._keeps_caller_salt, session=s.session_id,
                        tenant=s.tenant)  # so is a bad salt of the caller's own; another is replaced
    payload = request_payload(kwargs, s._backends(), s.counters.values())
    if payload.messages is None and not text:
        raise ValueError("Session.completion needs 'messages'; 'prompt' alone is a text completion")
    s._history = [*s._history[-1:], detached(payload)]  # as sent, whatever the caller edits later
    return payload


def decide(s: SessionState, kwargs: Mapping[str, Any], counted: TokenCount, known: Facts) -> RouteDecision:
    return decide_route(route_tokens=counted.total, safe_tokens=counted.safe, max_tokens=max_tokens_of(kwargs),
                        fast=known.fast, slow=known.slow, policy=s.routing, count_source=counted.source)


def plan(s: SessionState, kwargs: dict[str, Any], payload: Payload, counted: TokenCount, known: Facts, *,
         headers: Mapping[str, str] | None = None) -> Attempt:
    """The turn's first attempt: routed, clamped, addressed (a pool's replica for this conversation), logged.
    ``headers``: a raw request's own (the routing ones among them ride on its warm)."""
    try:
        decision = decide(s, kwargs, counted, known)
    except ContextOverflowError:
        s._stats.add("slow_overflow_refusals")
        raise
    if decision.note:
        s._stats.add("catalog_refusals")
    log_route(s, decision, counted)
    if payload.messages is not None and s.cache_end is not None and len(payload.messages) < s.cache_end:
        s.cache_end = None  # the history shrank (compacted): the last write's end is no longer in it
    attempt = Attempt(decision, s._addressed(decision.role, known), kwargs, payload, counted, s.cache_salt,
                      timeout_s=s.request_timeout_s, sent_at=s._stamp(), keeps_caller_salt=s._keeps_caller_salt,
                      routing_key=s.routing_key, headers=headers or {}, cache_end=s.cache_end)
    turns.planned(attempt, tenant=s._tenant_digest, conversation=s.routing_key, warm_span=s._warm.span,
                  escalation=is_escalation(s._record.previous_role, decision))
    return attempt


def log_route(s: SessionState, decision: RouteDecision, counted: TokenCount) -> None:
    s.last_route = decision
    emit(
        "route", reason=decision.reason, target=decision.backend, role=decision.role,
        estimate=decision.estimated_input_tokens, floor=s.routing.output_floor, window=decision.window,
        max_tokens=decision.max_tokens, count_source=counted.source, exact=counted.exact,
        tool_tokens=counted.tools, session=s.session_id, tenant=s.tenant, note=decision.note or None,
        **(prompt_fields(s._history[-1] if s._history else None) if enabled("info") else {}),
    )


def next_step(s: SessionState, attempt: Attempt, outcome: Outcome | None) -> Action:
    """What ``attempt``'s turn does next (:func:`~agentkv._session.decide.next_action` over this Session's state)."""
    return next_action(attempt.decision, outcome, handed_off=attempt.handed_off, handoff_active=s.handoff.active,
                       previous_role=s._record.previous_role, has_slow=s.slow is not None, retry=s.retry,
                       streamed=attempt.turn.streamed, other_replica=_other_replica(s, attempt),
                       pooled=attempt.backend.label in s.replicas)


def _other_replica(s: SessionState, attempt: Attempt) -> bool:
    """Whether ``attempt``'s backend is a pool with a replica besides this try's not found down this turn."""
    pool = s.replicas.get(attempt.backend.label)
    return pool is not None and any(url != attempt.backend.api_base and url not in attempt.turn.replicas_down
                                    for url in pool)


# ----------------------------------------------------------------- the handoff, at the answer

def hand_off(s: SessionState, attempt: Attempt) -> None:
    """The KV handoff before the escalated try (torch work or an export: the async loop runs it on a thread)."""
    if s.slow is None:
        return
    attempt.handed_off = True
    previous = s._history[-2] if len(s._history) > 1 else None  # what fast last served: cheap to export
    fast = s._addressed("fast")
    span = turns.handoff_span(attempt)
    outcome = s.handoff.at_escalation(fast, attempt.backend, attempt.payload, s.cache_salt, attempt=attempt,
                                      previous=previous, warm=s._warm, http=s.http,
                                      headers=routing_headers(fast, s.routing_key))
    ended(span, attributes={"agentkv.handoff.mapped_tokens": outcome.mapped_tokens,
                            "agentkv.handoff.fallback": outcome.fallback})
    s._stats.add("mapped_tokens", outcome.mapped_tokens)
    s._stats.add("handoff_fallbacks", int(outcome.fallback))


def finish(s: SessionState, attempt: Attempt, response: Any, *, asynchronous: bool) -> Any:
    """Record the answered ``attempt``: stats, the ledger row, the escalation, its import, its cached tokens."""
    s.handoff.answered(attempt.handoff_export, response, s._stats)  # what slow loaded for the import named
    escalation = is_escalation(s._record.previous_role, attempt.decision)
    warmed, warm_tokens = s._warm.warmed, s._warm.warmed_tokens
    expected = _expected_prefix(s, attempt, escalation)
    prediction = _predict(s, attempt, asynchronous)

    if escalation and s.slow is not None:
        hosted.tally(s, s._backend("slow"), None, escalated=True)

    def on_usage(usage: Usage) -> None:
        if prediction is not None:
            prediction.reported(usage.cached_tokens)
        account(s._stats, attempt.backend, usage, escalation=escalation and warmed is not None, session=s.session_id)
        _answered_usage(s, attempt, usage, expected)
        turns.answered(attempt, usage, escalation=escalation, warm_tokens=warm_tokens if warmed is not None else None)

    result = s._record.finish(attempt, response, escalation=escalation, after_warm=warmed is not None,
                              on_usage=on_usage, pooled=attempt.backend.label in s.replicas)
    if escalation and warmed is not None:  # the broken-warm diagnostic, off the request path
        schedule_warm_prefix_check(s._jobs, s._counter(attempt.backend), warmed, attempt.payload, s._stats,
                                   s.session_id, asynchronous=asynchronous)
    return result


def _expected_prefix(s: SessionState, attempt: Attempt, escalation: bool) -> int | None:
    """The prefix a slow turn should find cached: what the warm sent before an escalation, else the previous slow
    turn's prompt (None for a fast turn, or with nothing to expect)."""
    if attempt.decision.role != "slow":
        return None
    return s._warm.warmed_tokens if escalation else s.slow_prompt_tokens


def _affinity(s: SessionState, attempt: Attempt, usage: Usage, expected: int | None) -> None:
    """Count an affinity miss (a slow turn finding far less cached than it should), and remember this slow prompt."""
    if attempt.decision.role != "slow":
        return
    if affinity_missed(expected, usage.cached_tokens):
        s._stats.add("affinity_misses")
        emit("affinity_miss", level="warning", backend=attempt.backend.label, expected=expected,
             cached=usage.cached_tokens, session=s.session_id, tenant=s.tenant)
    s.slow_prompt_tokens = usage.prompt_tokens
    if attempt.payload.messages is not None and (not attempt.backend.explicit_cache or explicit_cache_moves(usage)):
        s.cache_end = len(attempt.payload.messages)  # this turn's marks wrote (or the next one's write) up to here


def _answered_usage(s: SessionState, attempt: Attempt, usage: Usage, expected: int | None = None) -> None:
    """What an answer's usage teaches: the server's prompt count is this Session's claim toward the backend's
    estimate bound (:mod:`agentkv.tokens.bound`: no single answer widens it), and a silent server clamp (vLLM 0.32:
    200, ``finish_reason`` "length", fewer tokens than sent) is recorded and sends discovery back to the server for
    the real window. ``usage`` was checked when read (:func:`agentkv.wire.usage.token_figure`)."""
    _affinity(s, attempt, usage, expected)
    if usage.prompt_tokens is not None:
        s._counter(attempt.backend).learn(attempt.payload, usage.prompt_tokens, origin="usage", session=s.session_id)
    if server_clamped(usage, attempt.decision.max_tokens):
        s._record.server_clamp(attempt, usage, session=s.session_id, tenant=s.tenant)
        s.discovery.rediscover(attempt.backend)


def _predict(s: SessionState, attempt: Attempt, asynchronous: bool) -> Prediction | None:
    """Start the ledger's prediction for a request to a backend it follows (worked out in the background)."""
    ledger, sent_at = s.cache_ledger, attempt.sent_at
    if ledger is None or sent_at is None or not ledger.follows(attempt.backend):
        return None
    prediction = Prediction(ledger, attempt.backend, s._stats)
    schedule_prediction(s._jobs, prediction, s._counter(attempt.backend), attempt.payload, attempt.cache_salt,
                        sent_at, asynchronous=asynchronous)
    return prediction


# ----------------------------------------------------------------- warm-ahead

def maybe_warm(s: SessionState, attempt: Attempt, known: Facts) -> None:
    """Consider warm-ahead for ``attempt`` and fire it on a pool thread when due."""
    if s.slow is not None:
        slow = _warm_target(s, known)
        attempt.warm = s._warm.consider(attempt.payload, **_warm_inputs(s, attempt, known, slow))
        hosted.tally(s, s._backend("slow"), attempt.warm, escalated=False)
        _send_warm(s, attempt, slow, asynchronous=False)
        _check_warm_replica(s, attempt, slow, asynchronous=False)
        turns.warmed(attempt)


async def amaybe_warm(s: SessionState, attempt: Attempt, known: Facts) -> None:
    """The async twin of :func:`maybe_warm`: the shared store's claim is awaited, the warm runs as a task."""
    if s.slow is not None:
        slow = _warm_target(s, known)
        attempt.warm = await s._warm.aconsider(attempt.payload, **_warm_inputs(s, attempt, known, slow))
        hosted.tally(s, s._backend("slow"), attempt.warm, escalated=False)
        _send_warm(s, attempt, slow, asynchronous=True)
        _check_warm_replica(s, attempt, slow, asynchronous=True)
        turns.warmed(attempt)


def _check_warm_replica(s: SessionState, attempt: Attempt, slow: Backend, *, asynchronous: bool) -> None:
    """A conversation warmed on a pool's replica and still on fast: check, in the background and at most every few
    seconds per replica, that the replica is up (``/health``). One found dead is ejected, and the conversation is
    warmed again on its next replica at once, in the same background job (with this turn's request: the prefix the
    last warm sent and what came since), so that its escalation, even its very next turn, finds it warm."""
    if attempt.warm != "cooldown" or s._warm.replica is None or attempt.decision.role != "fast":
        return
    _probe(s, s._warm.replica, slow.server_root, asynchronous=asynchronous, rewarm=attempt)


def _rewarm_moved(s: SessionState, attempt: Attempt) -> None:
    """(A health check's job) ``attempt``'s conversation lost the replica its warm sat on: warm its next one now."""
    try:
        slow = _warm_target(s, facts(s))  # the replica found dead is out: the conversation's next one
        if s._warm.moved(attempt.payload, attempt.count.total):
            _send_warm(s, replace(attempt, warm="fire"), slow, asynchronous=False)
    except Exception as exc:  # a background re-warm never raises into anyone
        _move_failed(s, exc)


async def _arewarm_moved(s: SessionState, attempt: Attempt) -> None:
    try:
        slow = _warm_target(s, await afacts(s))
        if await s._warm.amoved(attempt.payload, attempt.count.total):
            _send_warm(s, replace(attempt, warm="fire"), slow, asynchronous=True)
    except Exception as exc:
        _move_failed(s, exc)


def _move_failed(s: SessionState, exc: Exception) -> None:
    s._stats.add("warm_failed")
    emit("warm_replica_move_failed", level="warning", error=type(exc).__name__, session=s.session_id)


def _snapshot(attempt: Attempt) -> Attempt:
    """``attempt`` as it is now (its messages list and payload copied), for a job that may run after the caller has
    appended to its own list."""
    kwargs = dict(attempt.kwargs)
    if isinstance(kwargs.get("messages"), list):
        kwargs["messages"] = list(kwargs["messages"])
    return replace(attempt, kwargs=kwargs, payload=detached(attempt.payload))


def _probe_probation(s: SessionState, *, asynchronous: bool) -> None:
    """Check the pooled replicas whose cool-off is over (each at most every few seconds per process): one found up
    takes traffic again, one still down is ejected again."""
    for url in s.ejections.on_probation(s.pooled):
        backend = next((pool[url] for pool in s.replicas.values() if url in pool), None)
        if backend is not None:
            _probe(s, url, backend.server_root, asynchronous=asynchronous)


def _probe(s: SessionState, replica: str, root: str | None, *, asynchronous: bool,
           rewarm: Attempt | None = None) -> None:
    """``GET {root}/health`` in the background, when due for ``replica``: up confirms it, an outage ejects it (and,
    with ``rewarm``, the attempt whose conversation's warm sat on it, warms that conversation's next replica)."""
    if root is None or not s.ejections.probe_due(replica):
        return
    url, cooloff = f"{root}/health", s.retry.replica_cooloff_s
    moved = None if rewarm is None else _snapshot(rewarm)

    def probe() -> None:
        try:
            s.http.get_text(url, timeout_s=2.0)
        except Exception as error:  # a probe never raises into anyone
            if _probe_outage(error):
                s.ejections.mark(replica, cooloff)
                if moved is not None:
                    _rewarm_moved(s, moved)
            return
        if s.ejections.on_probation((replica,)):
            s.ejections.confirm(replica)

    async def aprobe() -> None:
        try:
            await s.http.aget_text(url, timeout_s=2.0)
        except Exception as error:
            if _probe_outage(error):
                await s.ejections.amark(replica, cooloff)
                if moved is not None:
                    await _arewarm_moved(s, moved)
            return
        if s.ejections.on_probation((replica,)):
            s.ejections.confirm(replica)

    if asynchronous:
        s._jobs.task(aprobe(), 3.0 if moved is None else 3.0 + s.warm_ahead.timeout_s)
    else:
        s._jobs.thread(probe)


def _probe_outage(error: Exception) -> bool:
    """A health check's failure that says the replica is down: unreachable, timed out, or a 5xx."""
    status = getattr(error, "status_code", None)
    return outage_cause(error) is not None or getattr(error, "timed_out", False) is True or (
        isinstance(status, int) and status >= 500)

def _warm_target(s: SessionState, known: Facts) -> Backend:
    """Where this conversation's escalation would go now: a pool's replica for it (a warm there is claimed apart from
    one on another replica, so a conversation moved off a replica that went down is warmed again on its new one)."""
    slow = s._addressed("slow", known)
    s._warm.retarget(slow.api_base if s._backend("slow").is_pool else None)
    if s.residency is not None and s._backend("slow").is_pool:  # the ledger's view of this conversation's replica
        followed = s.residency.ledger.follows(slow)
        if followed:
            s.residency.backend = slow
        s._warm.residency = s.residency if followed else None  # a replica it does not follow: the cooldown decides
    return slow


def _warm_inputs(s: SessionState, attempt: Attempt, known: Facts, slow: Backend) -> dict[str, Any]:
    boundary = None if known.fast.window is None else known.fast.window - s.routing.output_floor
    return dict(estimated_tokens=attempt.count.total, fast_window=known.fast.window,
                routed_role=attempt.decision.role, model_known=known.slow_model_known,
                enabled=_env.warm_ahead_enabled(), boundary_tokens=boundary, **hosted.inputs(s, slow))


def _send_warm(s: SessionState, attempt: Attempt, slow: Backend, asynchronous: bool) -> None:
    if not s._warm.wants_send(attempt.warm):
        return
    text = attempt.text  # a text completion warms ``/completions`` with its prompt
    url = raw_warm_target(slow, text=text)
    trace = None if attempt.span is None else (attempt.span, turns.warm_attributes(slow, attempt.count.total))
    try:
        if url is None and text:
            raise ValueError("a text completion is warmed only by a raw POST to a self-hosted slow backend")
        if url is not None:  # a raw POST: the same bytes as the request, no litellm import on the way
            body = warm_body(slow, attempt.kwargs, s.cache_salt, raw=attempt.raw,
                             keep_caller_salt=attempt.keeps_caller_salt, routing_key=s.routing_key)
            caller = attempt.headers if attempt.raw else attempt.kwargs.get("extra_headers")
            headers = routing_headers(slow, s.routing_key, caller if isinstance(caller, Mapping) else None)
            (s._warm.apost if asynchronous else s._warm.post)(url, body, s.http, headers, trace)
            return
        call = warm_kwargs(slow, attempt.kwargs, s.cache_salt, s.warm_ahead.timeout_s,
                           keep_caller_salt=attempt.keeps_caller_salt, routing_key=s.routing_key)
        if attempt.payload.messages is not None:  # a hosted slow's next requests mark where this warm wrote
            s.cache_end = len(attempt.payload.messages)
    except Exception as exc:  # building a warm never raises into the caller
        s._warm.abandon(exc)
        return
    s._warm.accounted = None if slow.self_hosted else (slow, call)  # its answer's cost, the cache it created
    (s._warm.asend if asynchronous else s._warm.send)(call, s.client, trace)


# ----------------------------------------------------------------- a pool's replica found down

def eject(s: SessionState, attempt: Attempt, error: Exception) -> None:
    """``attempt``'s replica failed the try with ``error`` (an outage: the turn fails over): never tried again this
    turn, and its breaker told (:mod:`agentkv.fleet.breaker`): it is ejected for the retry policy's cool-off only on
    evidence that it is failing (a refused or reset connection; failures of several conversations in a row), not for
    this request's failure. Nothing for a backend that is no pool."""
    failed = _pooled_replica(s, attempt, error)
    if failed is not None:
        s.ejections.observe(*failed, session=s.session_id, tenant=s.tenant, cooloff_s=s.retry.replica_cooloff_s)


async def aeject(s: SessionState, attempt: Attempt, error: Exception) -> None:
    failed = _pooled_replica(s, attempt, error)
    if failed is not None:
        await s.ejections.aobserve(*failed, session=s.session_id, tenant=s.tenant,
                                   cooloff_s=s.retry.replica_cooloff_s)


def _pooled_replica(s: SessionState, attempt: Attempt, error: Exception) -> tuple[str, Evidence] | None:
    """The failed try's replica and what its error says about it (recorded on the turn), or None (no pool's)."""
    url = attempt.backend.api_base
    if url is None or url not in s.replicas.get(attempt.backend.label, {}):
        return None
    evidence = replica_evidence(error, fails_over=s.retry.fails_over(error, streamed=attempt.turn.streamed))
    if evidence is None:
        return None
    attempt.turn.replicas_down.add(url)
    attempt.turn.replica_failures[url] = replica_state(error)
    return url, evidence
