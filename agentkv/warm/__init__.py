"""Warm-ahead: a one-token request that makes the big model prefill the conversation early.

When a session's estimated input crosses ``threshold`` x the fast window, agentkv sends the slow
backend the same messages, tools and salt with ``max_tokens=1`` and does not wait for it. The slow
server's prefix cache then holds the conversation when escalation comes.

- :mod:`agentkv.warm.policy`: :class:`WarmAheadPolicy` and the pure :func:`decide_warm`;
- :mod:`agentkv.warm.economics`: the break-even gate (pure): warm only when an escalation is forecast within
  the slow cache's expected lifetime;
- :mod:`agentkv.state.guards`: the tenant-scoped :class:`CooldownMap` and the :class:`InFlightLimit`;
- :mod:`agentkv.warm.claims`: a warm's claims on the state store (cooldown, in-flight slot), as machines;
- :mod:`agentkv.warm.sender`: the decision and its claim (:class:`~agentkv.warm.sender.Claimed`), the plan
  (:class:`~agentkv.warm.sender.WarmPlan`) and the executor, spawned by the turn;
- :mod:`agentkv.warm.events`: event-aware mode's pure :func:`decide_event_warm` over a :class:`Residency`
  (skip a resident prefix, re-warm an evicted one, top up a growing tail), read by
  :mod:`agentkv.warm.aware` from a :class:`~agentkv.cache_ledger.CacheLedger`.
"""

from agentkv.warm.economics import Forecast, TurnSample, decide_break_even, forecast_escalation
from agentkv.state.guards import CooldownMap, InFlightLimit, TenantCooldowns, shared_cooldowns, shared_in_flight
from agentkv.warm.events import EventOutcome, Residency, decide_event_warm
from agentkv.warm.policy import WarmAheadPolicy, WarmDecision, WarmOutcome, decide_warm

__all__ = [
    "CooldownMap",
    "EventOutcome",
    "Forecast",
    "InFlightLimit",
    "Residency",
    "TenantCooldowns",
    "TurnSample",
    "WarmAheadPolicy",
    "WarmDecision",
    "WarmOutcome",
    "decide_break_even",
    "decide_event_warm",
    "decide_warm",
    "forecast_escalation",
    "shared_cooldowns",
    "shared_in_flight",
]
