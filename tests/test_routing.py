"""Proactive routing and recovery planning are pure decisions at exact boundaries."""

import pytest

from agentkv.errors import ConfigurationError, ContextOverflowError
from agentkv.overflow import parse_overflow
from agentkv.routing import RoutePolicy, Target, decide_route, plan_recovery

FAST = Target("fast", 16384)
SLOW = Target("slow", 131072)
FLOOR = 256


def route(tokens, max_tokens=None, safe=None, slow=SLOW, fast=FAST):
    return decide_route(route_tokens=tokens, safe_tokens=safe if safe is not None else tokens,
                        max_tokens=max_tokens, fast=fast, slow=slow)


@pytest.mark.parametrize("tokens,expected", [
    (16384 - FLOOR - 1, "fast"), (16384 - FLOOR, "fast"), (16384 - FLOOR + 1, "slow"),
])
def test_boundary(tokens, expected):
    """window - floor - 1 and window - floor stay on fast; window - floor + 1 goes to slow."""
    decision = route(tokens)
    assert decision.role == expected
    assert decision.reason == ("fits" if expected == "fast" else "proactive")


def test_production_case_goes_to_slow_first():
    """The 12289 + 4096 > 16384 case from production is clamped, not sent doomed."""
    decision = route(12289, max_tokens=4096)
    assert (decision.role, decision.reason, decision.max_tokens) == ("fast", "clamped", 16384 - 12289)


def test_clamp_uses_safe_estimate():
    """The clamp leaves room for the over-estimate, routing uses the under-estimate."""
    decision = route(12000, max_tokens=8000, safe=13000)
    assert decision.reason == "clamped" and decision.max_tokens == 16384 - 13000


def test_clamp_below_min_output_escalates():
    """A clamp that would leave less than min_output routes to slow instead."""
    decision = route(16000, max_tokens=4096, safe=16200)
    assert decision.role == "slow" and decision.max_tokens == 4096


def test_clamp_at_exact_min_output():
    """Exactly min_output left is still a clamp."""
    decision = route(16384 - 256, max_tokens=1000, fast=Target("fast", 16384 + 0))
    assert decision.role == "fast" and decision.max_tokens == 256


def test_no_max_tokens_routes_by_floor_only():
    """Without max_tokens only the floor counts."""
    assert route(16000).role == "fast"


def test_slow_too_small_raises_naming_both_windows():
    """A request no backend can hold raises, naming both windows and the count, and nothing is sent."""
    with pytest.raises(ContextOverflowError) as info:
        route(200_000)
    assert "16384" in str(info.value) and "131072" in str(info.value) and "200000" in str(info.value)
    assert info.value.windows == {"fast": 16384, "slow": 131072}


def test_unusable_slow_keeps_request_on_fast_with_note():
    """An unmappable cloud slow model keeps the request local and says why."""
    slow = Target("gpt-x", None, usable=False, why_unusable="not in catalog")
    decision = route(20000, slow=slow)
    assert decision.role == "fast" and "not in catalog" in decision.note


def test_unknown_fast_window_stays_fast():
    """With no known window there is nothing to route on; the reactive path is underneath."""
    assert route(10**6, fast=Target("fast", None)).role == "fast"


def test_slow_budget_is_clamped_to_slow_window():
    """An escalated request's max_tokens is clamped to what the slow window holds."""
    decision = route(20000, max_tokens=200_000)
    assert decision.role == "slow" and decision.max_tokens == 131072 - 20000


def test_policy_validation():
    """A bad policy value is refused with its name."""
    with pytest.raises(ConfigurationError, match="output_floor"):
        RoutePolicy(output_floor=0)


V4 = ("This model's maximum context length is 16384 tokens. However, you requested 4096 output tokens and your "
      "prompt contains at least 12289 input tokens, for a total of at least 16385 tokens.")


def test_at_least_never_clamps_to_m_minus_1():
    """Without a real count the 'at least' threshold escalates instead of clamping to M-1 forever."""
    plan = plan_recovery(parse_overflow(V4), role="fast", exact_prompt_tokens=None, requested_max_tokens=4096,
                         known_window=16384, already_clamped=False, slow_usable=True)
    assert plan.action == "escalate"


def test_at_least_with_exact_count_clamps():
    """With an exact prompt count the recovery clamps to what really fits."""
    plan = plan_recovery(parse_overflow(V4), role="fast", exact_prompt_tokens=12500, requested_max_tokens=4096,
                         known_window=16384, already_clamped=False, slow_usable=True)
    assert (plan.action, plan.max_tokens) == ("clamp", 16384 - 12500)


def test_second_overflow_after_clamp_escalates():
    """A clamp is tried once; a second overflow escalates."""
    plan = plan_recovery(parse_overflow(V4), role="fast", exact_prompt_tokens=12500, requested_max_tokens=3884,
                         known_window=16384, already_clamped=True, slow_usable=True)
    assert plan.action == "escalate"


def test_slow_overflow_without_room_gives_up():
    """On slow with no room there is nowhere to go."""
    text = V4.replace("16384", "131072")
    plan = plan_recovery(parse_overflow(text), role="slow", exact_prompt_tokens=131000, requested_max_tokens=4096,
                         known_window=131072, already_clamped=False, slow_usable=False)
    assert plan.action == "give_up"


def test_recovery_reports_corrected_window():
    """A server window that disagrees with the cached one is reported for correction."""
    plan = plan_recovery(parse_overflow(V4), role="fast", exact_prompt_tokens=12500, requested_max_tokens=4096,
                         known_window=32768, already_clamped=False, slow_usable=True)
    assert plan.corrected_window == 16384


def test_prompt_alone_over_the_window_escalates_from_the_servers_floor():
    """vLLM 0.32's "at least L+1 input tokens" beats a lower count of our own: no clamp is retried on fast, and
    slow's budget is counted from at least L+1."""
    from agentkv.overflow import Overflow
    from agentkv.routing import plan_recovery

    overflow = Overflow("prompt_over_window", 2048, 2049, prompt_is_lower_bound=True)
    plan = plan_recovery(overflow, role="fast", exact_prompt_tokens=None, requested_max_tokens=2000,
                         known_window=8192, already_clamped=False, slow_usable=True, safe_prompt_tokens=1666)
    assert (plan.action, plan.prompt_tokens) == ("escalate", 2049)
