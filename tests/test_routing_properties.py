"""Property tests: the recovery planner never plans an output the window cannot hold, and never loops."""

from __future__ import annotations

from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.overflow import Overflow, parse_overflow
from agentkv.routing import Recovery, RoutePolicy, plan_recovery, slow_budget

PROPERTY = settings(max_examples=200, deadline=None)

counts = st.integers(min_value=0, max_value=2_000_000)
maybe = st.none() | counts
windows = st.integers(min_value=1, max_value=2_000_000)
policies = st.builds(RoutePolicy, output_floor=st.integers(1, 4_096), min_output=st.integers(1, 4_096))
overflows = st.builds(
    Overflow,
    variant=st.sampled_from(["messages_and_completion", "max_tokens_too_large", "at_least", "input_tokens",
                             "decoder_prompt", "max_tokens_over_window", "prompt_too_long", "unparsed"]),
    max_context=st.none() | st.integers(0, 2_000_000),
    prompt_tokens=maybe,
    requested_output=maybe,
    prompt_is_lower_bound=st.booleans(),
)
plans = st.fixed_dictionaries({
    "overflow": overflows,
    "role": st.sampled_from(["fast", "slow"]),
    "exact_prompt_tokens": maybe,
    "requested_max_tokens": st.none() | st.integers(1, 2_000_000),
    "known_window": st.none() | windows,
    "already_clamped": st.booleans(),
    "slow_usable": st.booleans(),
    "policy": policies,
    "safe_prompt_tokens": maybe,
})


@PROPERTY
@given(plans)
def test_a_clamp_fits_the_window_and_is_a_real_change(args: dict) -> None:
    """A clamp leaves at least min_output (so never a non-positive budget), fits the window, and asks for less than before."""
    plan = plan_recovery(**args)
    if plan.action != "clamp":
        return
    window = args["overflow"].max_context or args["known_window"]
    assert plan.max_tokens is not None and plan.prompt_tokens is not None and window is not None
    assert 1 <= args["policy"].min_output <= plan.max_tokens
    assert plan.prompt_tokens + plan.max_tokens <= window
    assert args["requested_max_tokens"] is None or plan.max_tokens < args["requested_max_tokens"]


@PROPERTY
@given(plans)
def test_a_second_overflow_never_clamps_again(args: dict) -> None:
    """After one clamp the planner escalates or gives up: it never plans a second clamp on the same backend."""
    assert plan_recovery(**{**args, "already_clamped": True}).action != "clamp"


@PROPERTY
@given(plans)
def test_escalation_only_from_fast_to_a_usable_slow(args: dict) -> None:
    """Escalate is planned only on fast with a usable slow; give_up only when that escalation is impossible."""
    plan = plan_recovery(**args)
    can_escalate = args["role"] == "fast" and args["slow_usable"]
    assert plan.action in ("clamp", "escalate" if can_escalate else "give_up")


@PROPERTY
@given(plans)
def test_a_threshold_is_never_taken_for_the_prompt(args: dict) -> None:
    """With no count of our own, an 'at least' threshold is never used as the prompt length, so it never clamps."""
    args = {**args, "exact_prompt_tokens": None, "safe_prompt_tokens": None,
            "overflow": Overflow("at_least", args["overflow"].max_context, args["overflow"].prompt_tokens,
                                 args["overflow"].requested_output, prompt_is_lower_bound=True)}
    plan = plan_recovery(**args)
    assert plan.action != "clamp" and plan.prompt_tokens is None


@PROPERTY
@given(plans)
def test_the_exact_count_wins_and_a_correction_is_a_real_change(args: dict) -> None:
    """An exact count is the prompt the plan uses; a corrected window is the server's, and differs from ours."""
    plan = plan_recovery(**args)
    if args["exact_prompt_tokens"] is not None:
        assert plan.prompt_tokens == args["exact_prompt_tokens"]
    if plan.corrected_window is not None:
        assert plan.corrected_window == args["overflow"].max_context != args["known_window"]


# --- the planner driven against a simulated vLLM that answers in its real wordings ---------------------

WORDING = {
    "at_least": "This model's maximum context length is {L} tokens. However, you requested {M} output tokens and "
                "your prompt contains at least {T} input tokens, for a total of at least {S} tokens.",
    "max_tokens_too_large": "'max_tokens' or 'max_completion_tokens' is too large: {M}. This model's maximum "
                            "context length is {L} tokens and your request has {P} input tokens ({M} > {L} - {P}).",
    "messages_and_completion": "This model's maximum context length is {L} tokens. However, you requested {S} "
                               "tokens ({P} in the messages, {M} in the completion).",
    "prompt_too_long": "The prompt (total length {P}) is too long to fit into the model (context length {L}).",
}


def serve(window: int, prompt: int, max_tokens: int | None, wording: str) -> str | None:
    """A server's answer: None when the request fits, else its overflow message (prompt-only wordings when M is unset)."""
    if prompt + (max_tokens or 1) <= window:
        return None
    if max_tokens is None or prompt >= window:
        wording = "prompt_too_long"
    m = max_tokens or 1
    return WORDING[wording].format(L=window, M=m, P=prompt, T=window - m + 1, S=prompt + m)


def drive(fast: int, slow: int, prompt: int, requested: int | None, wording: str, exact: bool,
          policy: RoutePolicy) -> tuple[str, list[tuple[str, int | None]]]:
    """Run the reactive loop as the Session does; returns the outcome and every attempt (role, max_tokens)."""
    role: Literal["fast", "slow"] = "fast"
    max_tokens, clamped, attempts = requested, False, []
    while len(attempts) < 10:
        attempts.append((role, max_tokens))
        window = fast if role == "fast" else slow
        text = serve(window, prompt, max_tokens, wording)
        if text is None:
            return "served", attempts
        overflow = parse_overflow(text)
        assert overflow is not None, text
        plan: Recovery = plan_recovery(
            overflow, role=role, exact_prompt_tokens=prompt if exact else None, requested_max_tokens=max_tokens,
            known_window=window, already_clamped=clamped, slow_usable=role == "fast", policy=policy,
        )
        if plan.action == "give_up":
            return "gave_up", attempts
        if plan.action == "clamp":
            max_tokens, clamped = plan.max_tokens, True
        else:
            role, clamped = "slow", False
            estimate = plan.prompt_tokens or prompt  # the Session falls back to its own estimate: here the truth
            max_tokens = slow_budget(requested, estimate, estimate, slow)
    return "looped", attempts


@PROPERTY
@given(st.integers(64, 200_000), st.integers(0, 400_000), st.integers(0, 400_000), st.none() | st.integers(1, 100_000),
       st.sampled_from(sorted(WORDING)), st.booleans(), policies)
def test_the_reactive_loop_ends_within_four_attempts(
    fast: int, extra: int, prompt: int, requested: int | None, wording: str, exact: bool, policy: RoutePolicy
) -> None:
    """Whatever the server says, at most one clamp per backend then escalate or stop; an exact count that fits slow is served."""
    outcome, attempts = drive(fast, fast + extra, prompt, requested, wording, exact, policy)
    assert outcome != "looped" and len(attempts) <= 4, attempts
    for role in ("fast", "slow"):
        assert sum(1 for r, _ in attempts if r == role) <= 2
    assert all(m is None or m >= 1 for _, m in attempts)
    if exact and prompt < fast + extra:
        assert outcome == "served", attempts
