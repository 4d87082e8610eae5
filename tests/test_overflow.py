"""The overflow parser reads every vLLM wording, and knows a threshold from a prompt length."""

import pytest

from agentkv.overflow import Overflow, overflow_from_error, parse_overflow

V1 = ("This model's maximum context length is 16384 tokens. However, you requested 16400 tokens "
      "(12304 in the messages, 4096 in the completion). Please reduce the length of the messages or completion.")
V2 = ("'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum context length is 16384 "
      "tokens and your request has 12304 input tokens (4096 > 16384 - 12304).")
V3 = ("This model's maximum context length is 12288 tokens. However, your request has 12304 input tokens. "
      "Please reduce the length of the input messages. (parameter=input_tokens, value=12304)")
V4 = ("This model's maximum context length is 16384 tokens. However, you requested 4096 output tokens and your "
      "prompt contains at least 12289 input tokens, for a total of at least 16385 tokens. Please reduce the length "
      "of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=12289)")
V5a = ("The decoder prompt (length 17000) plus the number of requested output tokens (at least 1) is longer than "
       "the maximum model length of 16384. Make sure that `max_model_len` is no smaller than the number of text tokens.")
V5b = "The prompt (total length 17000) is too long to fit into the model (context length 16384)."


def test_variant_1_messages_and_completion():
    """The 'N in the messages, M in the completion' wording gives the real prompt and output."""
    assert parse_overflow(V1) == Overflow("messages_and_completion", 16384, 12304, 4096)


def test_variant_2_max_tokens_too_large():
    """The 'max_tokens is too large' wording gives L, P and M."""
    assert parse_overflow(V2) == Overflow("max_tokens_too_large", 16384, 12304, 4096)


def test_variant_3_input_tokens_has_no_trusted_window():
    """The input-only wording gives the prompt but not a trusted window (some releases sent L - M)."""
    found = parse_overflow(V3)
    assert found == Overflow("input_tokens", None, 12304)


def test_variant_4_at_least_is_a_threshold():
    """The current wording's 'at least L-M+1' is flagged a lower bound and never used to clamp."""
    found = parse_overflow(V4)
    assert found is not None and found.prompt_is_lower_bound
    assert (found.max_context, found.requested_output, found.prompt_tokens) == (16384, 4096, 12289)
    assert found.room_for_output() is None
    assert found.room_for_output(real_prompt_tokens=12000) == 4384


@pytest.mark.parametrize("text,prompt", [(V5a, 17000), (V5b, 17000)])
def test_variant_5_engine_level(text, prompt):
    """Both engine-level wordings give the prompt length and the model length."""
    found = parse_overflow(text)
    assert found is not None and (found.prompt_tokens, found.max_context) == (prompt, 16384)


def test_unrelated_text_is_not_overflow():
    """An error about something else is not an overflow."""
    assert parse_overflow("Invalid value for 'temperature': must be >= 0") is None


def test_numbers_with_commas():
    """Thousands separators are accepted."""
    found = parse_overflow(V1.replace("16384", "16,384"))
    assert found is not None and found.max_context == 16384


class BadRequestError(Exception):
    status_code = 400


class ContextWindowExceededError(BadRequestError):
    pass


class RateLimitError(Exception):
    status_code = 429


def test_error_classification():
    """A matching 400 or a ContextWindowExceededError is an overflow; a 429 with similar text is not."""
    body = '{"error": {"message": "%s", "type": "BadRequestError", "param": "input_tokens", "code": 400}}' % V4
    assert overflow_from_error(BadRequestError(f"litellm.BadRequestError: Hosted_vllmException - {body}")).variant == "at_least"
    assert overflow_from_error(ContextWindowExceededError("context window exceeded")).variant == "unparsed"
    assert overflow_from_error(RateLimitError(V4)) is None
    assert overflow_from_error(BadRequestError("unknown field 'foo'")) is None


def test_variant_max_tokens_over_window():
    """vLLM's 'max_tokens=M cannot be greater than max_model_len=L' gives L and M but no prompt."""
    text = ("max_tokens=4096 cannot be greater than max_model_len=max_total_tokens=2048. "
            "Please request fewer output tokens. (parameter=max_tokens, value=4096)")
    assert parse_overflow(text) == Overflow("max_tokens_over_window", 2048, None, 4096)


# vLLM 0.32.0's wordings, as the real server (CPU build, max_model_len=2048) answered them.
V032_AT_LEAST = ("This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                 "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                 "the input prompt. (parameter=input_tokens, value=2049)")
V032_EXACT = ("This model's maximum context length is 2048 tokens. However, your prompt contains 3000 input tokens, "
              "which exceeds this limit even without any output tokens. Please reduce the length of the input "
              "prompt. (parameter=input_tokens, value=3000)")
V032_CHARS = ("This model's maximum context length is 2048 tokens. However, your prompt contains 300050 characters "
              "(more than 131072 characters, which is the upper bound for 2048 input tokens). Please reduce the "
              "length of the input prompt. (parameter=input_text, value=300050)")
V032_MAX_TOKENS = ("max_tokens=5000 cannot be greater than max_model_len=2048. Please request fewer output tokens. "
                   "(parameter=max_tokens, value=5000)")
V032_MAX_COMPLETION = ("max_completion_tokens=5000 cannot be greater than max_model_len=2048. Please request fewer "
                       "output tokens. (parameter=max_completion_tokens, value=5000)")


def test_v032_prompt_alone_over_the_window_gives_the_window_and_a_threshold():
    """0.32's 'at least L+1 input tokens ... even without any output tokens' gives L, and L+1 only as a lower bound."""
    found = parse_overflow(V032_AT_LEAST)
    assert found == Overflow("prompt_over_window", 2048, 2049, prompt_is_lower_bound=True)
    assert found.room_for_output() is None


def test_v032_prompt_given_as_token_ids_states_its_exact_length():
    """Without 'at least' (a prompt of token ids is not truncated) the stated length is exact."""
    found = parse_overflow(V032_EXACT)
    assert found == Overflow("prompt_over_window", 2048, 3000)
    assert found.room_for_output() == -952


def test_v032_character_pre_check_gives_the_window_and_a_token_lower_bound():
    """The pre-tokenisation check gives L; n characters at 64 a token (131072 / 2048) are at least ceil(n / 64) tokens."""
    found = parse_overflow(V032_CHARS)
    assert found == Overflow("prompt_characters", 2048, 4689, prompt_is_lower_bound=True)


def test_v032_character_pre_check_lower_bound_is_never_below_the_window():
    """A text just over the character limit still reads as more than L tokens."""
    text = V032_CHARS.replace("300050", "131073")
    found = parse_overflow(text)
    assert found is not None and found.prompt_tokens == 2049 and found.prompt_is_lower_bound


@pytest.mark.parametrize("text,param", [(V032_MAX_TOKENS, "max_tokens"), (V032_MAX_COMPLETION, "max_completion_tokens"),
                                        (V032_MAX_TOKENS.replace("max_tokens=", "max_output_tokens="), "max_output_tokens")])
def test_v032_output_budget_over_the_window(text, param):
    """Each output-budget parameter's 'cannot be greater than max_model_len=L' gives L and the budget."""
    assert parse_overflow(text) == Overflow("max_tokens_over_window", 2048, None, 5000), param


@pytest.mark.parametrize("text", [V032_AT_LEAST, V032_EXACT, V032_CHARS, V032_MAX_TOKENS, V032_MAX_COMPLETION])
def test_v032_wordings_through_litellm_are_not_unparsed(text):
    """Wrapped as litellm's ContextWindowExceededError renders them, every 0.32 wording yields the window."""
    body = '{"error":{"message":"%s","type":"BadRequestError","param":"input_tokens","code":400}}' % text.replace("'", "\\'")
    found = overflow_from_error(ContextWindowExceededError(f"litellm.ContextWindowExceededError: {body}"))
    assert found is not None and found.variant != "unparsed" and found.max_context == 2048
