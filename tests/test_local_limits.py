"""Context-window checks answer with current vLLM's exact error text and JSON."""

from __future__ import annotations

from agentkv.local.limits import check_length, resolve_max_tokens


def test_fitting_request_passes():
    """A prompt plus output that exactly fills the window is accepted."""
    assert check_length(3000, 1096, 4096) is None


def test_prompt_plus_output_over_the_window_uses_the_current_wording():
    """Over the window, the message names the L-M+1 threshold ('at least'), not the real prompt length."""
    error = check_length(3500, 1000, 4096)
    assert error is not None
    assert error.message == (
        "This model's maximum context length is 4096 tokens. However, you requested 1000 output tokens and "
        "your prompt contains at least 3097 input tokens, for a total of at least 4097 tokens. Please reduce "
        "the length of the input prompt or the number of requested output tokens. "
        "(parameter=input_tokens, value=3097)"
    )
    assert error.body() == {"error": {"message": error.message, "type": "BadRequestError",
                                      "param": "input_tokens", "code": 400}}


def test_prompt_alone_over_the_window_without_max_tokens():
    """Without max_tokens the output budget is 0, so a prompt over the window reports 0 output tokens."""
    error = check_length(5000, None, 4096)
    assert error is not None and error.param == "input_tokens"
    assert "you requested 0 output tokens and your prompt contains at least 4097 input tokens, " \
           "for a total of at least 4097 tokens." in error.message


def test_prompt_exactly_filling_the_window_without_max_tokens():
    """A prompt of exactly the window leaves no room for one output token: vLLM's engine-level message."""
    error = check_length(4096, None, 4096)
    assert error is not None and error.param is None
    assert error.message.startswith("The decoder prompt (length 4096) plus the number of requested output "
                                    "tokens (at least 1) is longer than the maximum model length of 4096.")


def test_max_tokens_over_the_window_names_the_parameter_sent():
    """max_completion_tokens larger than the window is refused under the name the client used."""
    error = check_length(10, 5000, 4096, param="max_completion_tokens")
    assert error is not None and error.param == "max_completion_tokens"
    assert error.message == ("max_completion_tokens=5000 cannot be greater than max_model_len=max_total_tokens="
                             "4096. Please request fewer output tokens. "
                             "(parameter=max_completion_tokens, value=5000)")


def test_default_max_tokens_fills_the_rest_of_the_window():
    """Without max_tokens the request may generate up to the end of the window, as vLLM allows."""
    assert resolve_max_tokens(3000, None, 4096) == 1096
    assert resolve_max_tokens(3000, 64, 4096) == 64
