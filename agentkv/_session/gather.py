"""A turn's inputs, gathered through the seams, each step a machine (:mod:`agentkv._support.effects`) written once for
both drivers: the backends' window facts (a pool's: which replicas are down, the conversation's home), fast's count
(estimated, or exact where a decision depends on it), the failed backend's own count after an overflow, a pool's
replica reported to its breaker, and the background health checks of a pool's replicas.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable, Mapping

from agentkv._session import warming
from agentkv._session.attempts import Attempt
from agentkv._session.inputs import Facts, max_tokens_of, to_facts
from agentkv._session.parts import SessionParts
from agentkv._support.effects import Call, Machine, Spawn
from agentkv.backends import Backend, WindowInfo
from agentkv.events import emit
from agentkv.fleet import HOME_IDLE_S, HOME_SLACK, pool_window
from agentkv.fleet.breaker import Evidence
from agentkv.http import HttpError
from agentkv.retry import outage_cause, replica_evidence, replica_state
from agentkv.routing import interval_decides
from agentkv.state import StateUnavailable
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.payload import detached

__all__ = ["count", "decides", "eject", "facts", "recount", "watch_warm_replica"]

PROBE_TIMEOUT_S = 2.0


# ----------------------------------------------------------------- window facts

def facts(s: SessionParts) -> Machine[Facts]:
    """The backends' windows and served models, as discovered now (cached, single flight; a pool's per replica,
    the smallest used), and which pooled replicas are cooling off (those whose cool-off is over are probed)."""
    down: frozenset[str] = frozenset()
    if s.pooled:
        down = yield Call(s.ejections.down, s.ejections.adown, (s.pooled, s.tenant))
    if down:
        yield from _probe_probation(s)
    fast = yield from _window(s, s.fast, down, model_known=False)
    slow = None if s.slow is None else (yield from _window(s, s.slow, down, model_known=True))
    if not s.pooled:
        return to_facts(s.fast, s.slow, fast, slow)
    homes = {}
    for b in (b for b in s.backends() if b.is_pool):
        try:
            homes[b.label] = yield Call(s.state.home_replica, s.state.ahome_replica,
                                        (s.pool_ids[b.label], s.routing_key, s.rankings[b.label], down),
                                        {"slack": HOME_SLACK, "idle_s": HOME_IDLE_S, "tenant": s.tenant_digest or ""})
        except StateUnavailable:  # no home known: the conversation's first choice (rendezvous alone)
            pass
    s.last_facts = to_facts(s.fast, s.slow, fast, slow, down, homes)
    return s.last_facts


def _window(s: SessionParts, backend: Backend, down: frozenset[str], *, model_known: bool) -> Machine[WindowInfo]:
    """One backend's window info: a pool's is its smallest replica's up (a disagreement is warned of once)."""
    infos: list[WindowInfo] = []
    for member in s.members(backend, down):
        infos.append((yield from s.discovery.finding(member, model_known=model_known)))
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


# ----------------------------------------------------------------- counts

def count(s: SessionParts, kwargs: Mapping[str, Any], payload: Payload, known: Facts) -> Machine[TokenCount]:
    """Fast's count: the local estimate, or the exact one where a decision depends on it."""
    counter = s.counter(s.fast)
    counted: TokenCount = yield from counter.counting_for(payload, decides(s, kwargs, known))
    return counted


def decides(s: SessionParts, kwargs: Mapping[str, Any], known: Facts) -> Callable[[int, int], bool]:
    """Whether a count interval is enough for every decision this request meets (else it is counted exactly)."""
    warm = s.warm_ahead.threshold if s.slow is not None else None
    return functools.partial(interval_decides, max_tokens=max_tokens_of(kwargs), fast=known.fast, slow=known.slow,
                             policy=s.routing, warm_threshold=warm)


def recount(s: SessionParts, attempt: Attempt) -> Machine[TokenCount]:
    """The failed backend's count of the request: fast's exact count is reused, others are asked (and an
    exact answer teaches that backend's estimate bound)."""
    if attempt.count.exact and attempt.backend.label == s.fast.label:
        return attempt.count
    counter = s.counter(attempt.backend)
    counted: TokenCount = yield from counter.counting(attempt.payload)
    if counted.exact:
        counter.learn(attempt.payload, counted.total, origin="recovery")
    return counted


# ----------------------------------------------------------------- a pool's replica found down

def eject(s: SessionParts, attempt: Attempt, error: Exception) -> Machine[None]:
    """``attempt``'s replica failed the try with ``error`` (an outage: the turn fails over): never tried again this
    turn, and its breaker told (:mod:`agentkv.fleet.breaker`): it is ejected for the retry policy's cool-off only on
    evidence that it is failing (a refused or reset connection; failures of several conversations in a row), not for
    this request's failure. Nothing for a backend that is no pool."""
    failed = _pooled_replica(s, attempt, error)
    if failed is not None:
        yield Call(s.ejections.observe, s.ejections.aobserve, failed,
                   {"session": s.session_id, "tenant": s.tenant, "cooloff_s": s.retry.replica_cooloff_s})


def _pooled_replica(s: SessionParts, attempt: Attempt, error: Exception) -> tuple[str, Evidence] | None:
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


# ----------------------------------------------------------------- health checks, in the background

def watch_warm_replica(s: SessionParts, attempt: Attempt) -> Machine[None]:
    """A conversation warmed on a pool's replica and still on fast: check, in the background and at most every few
    seconds per replica, that the replica is up (``/health``). One found dead is ejected, and the conversation is
    warmed again on its next replica at once, in the same background job (with this turn's request: the prefix the
    last warm sent and what came since), so that its escalation, even its very next turn, finds it warm."""
    replica = s.warm.replica
    if s.slow is None or attempt.warm != "cooldown" or replica is None or attempt.decision.role != "fast":
        return
    yield from _probe(s, replica, s.slow.replica(replica).server_root, rewarm=attempt)


def _probe_probation(s: SessionParts) -> Machine[None]:
    """Check the pooled replicas whose cool-off is over (each at most every few seconds per process): one found up
    takes traffic again, one still down is ejected again."""
    for url in s.ejections.on_probation(s.pooled):
        backend = next((pool[url] for pool in s.replicas.values() if url in pool), None)
        if backend is not None:
            yield from _probe(s, url, backend.server_root)


def _probe(s: SessionParts, replica: str, root: str | None, *, rewarm: Attempt | None = None) -> Machine[None]:
    """``GET {root}/health`` in the background, when due for ``replica``: up confirms it, an outage ejects it (and,
    with ``rewarm``, the attempt whose conversation's warm sat on it, warms that conversation's next replica)."""
    if root is None or not s.ejections.probe_due(replica):
        return
    moved = None if rewarm is None else _snapshot(rewarm)
    yield Spawn(functools.partial(_health_check, s, replica, f"{root}/health", moved),
                PROBE_TIMEOUT_S + 1.0 + (0.0 if moved is None else s.warm_ahead.timeout_s))


def _health_check(s: SessionParts, replica: str, url: str, moved: Attempt | None) -> Machine[None]:
    try:
        yield Call(s.http.request, s.http.arequest, ("GET", url), {"timeout_s": PROBE_TIMEOUT_S, "text": True})
    except Exception as error:  # a probe never raises into anyone: its failure is the answer it looks for
        if not _probe_outage(error):
            return
        yield Call(s.ejections.mark, s.ejections.amark, (replica, s.retry.replica_cooloff_s))
        if moved is not None:
            yield from _rewarm_moved(s, moved)
        return
    if s.ejections.on_probation((replica,)):
        s.ejections.confirm(replica)


def _rewarm_moved(s: SessionParts, attempt: Attempt) -> Machine[None]:
    """(A health check's job) ``attempt``'s conversation lost the replica its warm sat on: warm its next one now."""
    try:
        known = yield from facts(s)  # the replica found dead is out: the conversation's next one
        yield from warming.rewarm_moved(s, attempt, known)
    except Exception as exc:  # a background re-warm never raises into anyone
        s.session_stats.add("warm_failed")
        emit("warm_replica_move_failed", level="warning", error=type(exc).__name__, session=s.session_id)


def _snapshot(attempt: Attempt) -> Attempt:
    """``attempt`` as it is now (its messages list and payload copied), for a job that may run after the caller has
    appended to its own list."""
    kwargs = dict(attempt.kwargs)
    if isinstance(kwargs.get("messages"), list):
        kwargs["messages"] = list(kwargs["messages"])
    return replace(attempt, kwargs=kwargs, payload=detached(attempt.payload))


def _probe_outage(error: Exception) -> bool:
    """A health check's failure that says the replica is down: unreachable, timed out, or a 5xx."""
    if isinstance(error, HttpError):
        return error.kind in ("outage", "timeout") or (error.status_code or 0) >= 500
    return outage_cause(error) is not None
