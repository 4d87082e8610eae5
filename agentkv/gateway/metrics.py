"""The gateway's Prometheus metrics (``prometheus_client``), served as text on ``GET /metrics``.

- ``agentkv_requests_total{backend,route}``: answers a backend produced, by the final route;
- ``agentkv_warms_total{outcome}``: warm-ahead decisions past the threshold (``fire``, ``cooldown``, ...);
- ``agentkv_overflows_recovered_total``: context overflows the Session recovered from (a clamp or an escalation);
- ``agentkv_failovers_total``: requests moved to the other backend because theirs was down;
- ``agentkv_gateway_sessions``: conversations held now (the bounded map's size);
- ``agentkv_gateway_rejections_total{status}``: answers the gateway made itself (400, 401, 413);
- ``agentkv_gateway_upstream_errors_total{backend,status}``: error answers passed on from a backend;
- ``agentkv_gateway_request_seconds{backend}``: time to the answer's headers;
- ``agentkv_gateway_presends_total``: requests written to fast before they were counted (Session.presend);
- ``agentkv_gateway_presend_discarded_total``: requests written to fast before they were counted (the Session
  vouched for them) and then abandoned, because the prepared try differed (none, while windows hold).

Each app has a registry of its own. With ``--workers N`` the command line sets ``PROMETHEUS_MULTIPROC_DIR``
and every worker's counts are summed on each scrape (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "NOT_WARMS", "ROUTES", "WARM_OUTCOMES"]

NOT_WARMS = frozenset({"", "below_threshold", "no_window", "routed_slow"})
"""Warm outcomes that are no warm decision at all (the request was far from the boundary, or went to slow)."""
ROUTES = ("fits", "clamped", "proactive", "reactive_clamp", "reactive_escalate", "failover")
"""The final route reasons an answer can carry (``x-agentkv-route``)."""
WARM_OUTCOMES = ("fire", "cooldown", "saturated", "state_unavailable", "disabled", "unknown_model", "break_even")
"""The warm-ahead outcomes past the threshold."""
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class GatewayMetrics:
    """One gateway's metrics and their exposition."""

    def __init__(self) -> None:
        shared = _multiprocess()
        registry = None if shared else CollectorRegistry()  # multiprocess: values live in the directory's files
        self._registry = registry
        self.requests = Counter("agentkv_requests_total", "Answers a backend produced, by backend and final route.",
                                ["backend", "route"], registry=registry)
        self.warms = Counter("agentkv_warms_total", "Warm-ahead decisions past the threshold, by outcome.",
                             ["outcome"], registry=registry)
        self.overflows_recovered = Counter("agentkv_overflows_recovered_total",
                                           "Context overflows recovered from by a clamp or an escalation.",
                                           registry=registry)
        self.failovers = Counter("agentkv_failovers_total", "Requests moved to the other backend (theirs was down).",
                                 registry=registry)
        self.sessions = Gauge("agentkv_gateway_sessions", "Conversations held in the bounded map.",
                              registry=registry, multiprocess_mode="livesum")  # the mode is read in multiprocess only
        self.rejections = Counter("agentkv_gateway_rejections_total", "Answers the gateway made itself, by status.",
                                  ["status"], registry=registry)
        self.upstream_errors = Counter("agentkv_gateway_upstream_errors_total",
                                       "Error answers passed on from a backend, by backend and status.",
                                       ["backend", "status"], registry=registry)
        self.presends = Counter("agentkv_gateway_presends_total",
                                "Requests written to fast before they were counted (the Session vouched for them).",
                                registry=registry)
        self.presend_discarded = Counter(
            "agentkv_gateway_presend_discarded_total",
            "Requests written to fast before they were counted, then abandoned: the Session prepared another try.",
            registry=registry)
        for role in ("fast", "slow"):  # every series a check may read exists from the start, at 0
            for route in ROUTES:
                self.requests.labels(role, route)
        for outcome in WARM_OUTCOMES:
            self.warms.labels(outcome)
        self.latency = Histogram("agentkv_gateway_request_seconds", "Seconds from the request to the answer's headers.",
                                 ["backend"], buckets=_BUCKETS, registry=registry)
        self._answered: dict[tuple[str, str], Any] = {}  # label children, looked up once (labels() takes a lock)
        self._latency: dict[str, Any] = {}

    def answered(self, backend: str, route: str) -> None:
        """Count an answer a backend produced, by its final route."""
        child = self._answered.get((backend, route))
        if child is None:
            child = self._answered[(backend, route)] = self.requests.labels(backend, route)
        child.inc()

    def observe(self, backend: str, seconds: float) -> None:
        """Record the time to an answer's headers."""
        child = self._latency.get(backend)
        if child is None:
            child = self._latency[backend] = self.latency.labels(backend)
        child.observe(seconds)

    def warm(self, outcome: str) -> None:
        """Count a request's warm outcome, unless it was no warm decision."""
        if outcome not in NOT_WARMS:
            self.warms.labels(outcome).inc()

    def render(self) -> bytes:
        """The exposition text of this process (or, in multiprocess mode, of every worker)."""
        registry: Any = self._registry
        if registry is None:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return bytes(generate_latest(registry))
