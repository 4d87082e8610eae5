"""A hosted slow model's share of a turn: the warm's cacheable minimum and cost premium, and the escalation tally
the cost gate learns from (each answer's dollars: :func:`agentkv.costs.account`).

Prices and minimums come from litellm's cost map, read only once litellm is loaded (a hosted model's requests
load it): never an import on a request's path.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from agentkv._defaults import shared
from agentkv.backends import Backend
from agentkv.costs import loaded_prices
from agentkv.events import emit
from agentkv.warm.economics import EscalationRate, warm_premium

if TYPE_CHECKING:
    from agentkv._session.state import SessionState

__all__ = ["cache_minimum", "escalation_rate", "inputs", "tally"]

DEFAULT_CACHE_MINIMUM = 1024
"""litellm's provider-agnostic shortest cacheable prompt (OpenAI's, and most Anthropic models')."""
_NOT_CROSSED = ("no_window", "below_threshold", "routed_slow")


def _litellm_loaded() -> bool:
    return "litellm" in sys.modules


def cache_minimum(backend: Backend) -> int | None:
    """A hosted model's shortest cacheable prompt (litellm's ``get_prompt_cache_min_tokens``), None when self-hosted."""
    if backend.self_hosted:
        return None
    if not _litellm_loaded():
        return DEFAULT_CACHE_MINIMUM
    found: dict[str, int] = shared("cache_minimums", dict)
    if backend.model not in found:
        from litellm.utils import get_prompt_cache_min_tokens

        found[backend.model] = int(get_prompt_cache_min_tokens(backend.model))
    return found[backend.model]


def escalation_rate(backend: Backend) -> EscalationRate:
    """This process's escalation tally for conversations warming toward ``backend``."""
    return shared(("escalation_rate", backend.label, backend.model), EscalationRate)


def inputs(s: "SessionState", slow: Backend) -> dict[str, Any]:
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


def tally(s: "SessionState", slow: Backend, outcome: str | None, *, escalated: bool) -> None:
    """Count this conversation's first crossing of the warm threshold, and its first escalation after one."""
    if outcome is not None and outcome not in _NOT_CROSSED and not s.crossed:
        s.crossed = True
        escalation_rate(slow).cross()
    if escalated and s.crossed and not s.escalation_tallied:
        s.escalation_tallied = True
        escalation_rate(slow).escalate()
