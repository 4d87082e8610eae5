"""Context-window checks answer with vLLM 0.32's exact error text and JSON, and clamp the output budget as it does."""

from __future__ import annotations

from agentkv.embedded.engine.limits import (
    check_length,
    engine_check,
    output_over_window,
    prompt_over_window,
    resolve_max_tokens,
    text_over_window,
)


def test_prompt_plus_output_over_the_window_is_served():
    """vLLM 0.32 no longer refuses prompt + max_tokens over the window: no error, the budget is clamped."""
    assert check_length(3500, 1000, 4096) is None
    assert resolve_max_tokens(3500, 1000, 4096) == 596


def test_prompt_alone_over_the_window_names_the_truncation_threshold():
    """A text prompt over the window is reported as 'at least L+1' tokens: vLLM tokenizes only that far."""
    error = check_length(5000, None, 4096)
    assert error is not None
    assert error.message == (
        "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=4097)"
    )
    assert error.body() == {"error": {"message": error.message, "type": "BadRequestError",
                                      "param": "input_tokens", "code": 400}}


def test_a_prompt_of_token_ids_over_the_window_gives_its_real_length():
    """Token ids are not truncated: the message names their count, 'at least' only at exactly L+1."""
    far = prompt_over_window(5000, 4096, truncated=False)
    assert far is not None and "your prompt contains 5000 input tokens, which exceeds" in far.message
    just = prompt_over_window(4097, 4096, truncated=False)
    assert just is not None and "contains at least 4097 input tokens" in just.message
    assert prompt_over_window(4096, 4096, truncated=False) is None


def test_max_tokens_over_the_window_names_the_parameter_sent():
    """max_completion_tokens larger than the window is refused under the name the client used, 0.32's wording."""
    error = check_length(10, 5000, 4096, param="max_completion_tokens")
    assert error is not None and error.param == "max_completion_tokens"
    assert error.message == ("max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request "
                             "fewer output tokens. (parameter=max_completion_tokens, value=5000)")
    assert output_over_window(4096, 4096) is None


def test_the_character_bound_comes_before_tokenizing():
    """Text longer than window x longest token is refused by its character count, as vLLM's pre-check does."""
    assert text_over_window(4096 * 16, 4096, 16) is None
    error = text_over_window(4096 * 16 + 1, 4096, 16)
    assert error is not None and error.param == "input_text"
    assert error.message == (
        "This model's maximum context length is 4096 tokens. However, your prompt contains 65537 characters (more "
        "than 65536 characters, which is the upper bound for 4096 input tokens). Please reduce the length of the "
        "input prompt. (parameter=input_text, value=65537)")


def test_default_max_tokens_fills_the_rest_of_the_window():
    """Without max_tokens the request may generate up to the end of the window, as vLLM allows."""
    assert resolve_max_tokens(3000, None, 4096) == 1096
    assert resolve_max_tokens(3000, 64, 4096) == 64


def test_a_prompt_filling_the_window_leaves_a_budget_of_zero():
    """The clamp is not floored: 0 (or a negative request) is left for the sampling check to refuse."""
    assert resolve_max_tokens(4096, 10, 4096) == 0
    assert resolve_max_tokens(10, -3, 4096) == -3


def test_the_engine_refuses_a_prompt_that_leaves_no_room():
    """The engine-level check: a prompt of the window or more has no room for one output token."""
    assert engine_check(4095, 4096) is None
    full = engine_check(4096, 4096)
    assert full is not None and full.message.startswith(
        "The decoder prompt (length 4096) plus the number of requested output tokens (at least 1) is longer than the "
        "maximum model length of 4096.")
    over = engine_check(5000, 4096)
    assert over is not None and over.message.startswith(
        "The decoder prompt (length 5000) is longer than the maximum model length of 4096.")
