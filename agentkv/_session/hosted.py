"""A hosted slow model's share of a turn: the warm's cacheable minimum and cost premium, and the escalation tally
the cost gate learns from (each answer's dollars: :func:`agentkv.costs.account`).

Prices and minimums come from litellm's cost map, read only once litellm is loaded (a hosted model's requests
load it): never an import on a request's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.backends import Backend
from agentkv._support.defaults import shared
from agentkv.events import emit
from agentkv.providers import loaded_prices, strategy_for
from agentkv.warm.economics import EscalationRate, warm_premium

if TYPE_CHECKING:
    from agentkv._session.parts import SessionParts

__all__ = ["cache_minimum", "escalation_rate", "inputs", "tally"]

_NOT_CROSSED = ("no_window", "below_threshold", "routed_slow")


def cache_minimum(backend: Backend) -> int | None:
    """A managed model's shortest cacheable prompt (its strategy's), None when self-hosted."""
    return strategy_for(backend).cache_minimum(backend)


def escalation_rate(backend: Backend) -> EscalationRate:
    """This process's escalation tally for conversations warming toward ``backend``."""
    return shared(("escalation_rate", backend.label, backend.model), EscalationRate)


def inputs(s: "SessionParts", slow: Backend) -> dict[str, Any]:
    """:func:`~agentkv.warm.policy.decide_warm`'s hosted inputs: the cacheable minimum and, for a cost-aware
    policy, the warm's premium (None while prices are unknown: the gate abstains). Never raises: without them the
    other guards decide."""
    if slow.self_hosted:
        return {}
    try:
        premium = None
        prices = loaded_prices(slow) if s.warm_ahead.cost_aware else None
        if prices is not None:
            premium = warm_premium(prices, escalation_rate=escalation_rate(slow).rate,
                                   writes_own_cache=not slow.explicit_cache)
        return {"min_cacheable": cache_minimum(slow), "premium": premium}
    except Exception as exc:  # litellm's helpers moved: warm as a self-hosted slow would be
        emit("hosted_inputs_unread", level="warning", backend=slow.label, error=type(exc).__name__)
        return {}


def tally(s: "SessionParts", slow: Backend, outcome: str | None, *, escalated: bool) -> None:
    """Count this conversation's first crossing of the warm threshold, and its first escalation after one."""
    if outcome is not None and outcome not in _NOT_CROSSED and not s.crossed:
        s.crossed = True
        escalation_rate(slow).cross()
    if escalated and s.crossed and not s.escalation_tallied:
        s.escalation_tallied = True
        escalation_rate(slow).escalate()
