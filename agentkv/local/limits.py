"""Context-window checks that answer exactly as current vLLM (>= 0.18) does, as pure functions.

vLLM validates a chat request in this order, and so do we:

1. ``max_tokens`` (or ``max_completion_tokens``) larger than the window;
2. prompt plus requested output over the window. vLLM tokenizes with truncation at ``L - M + 1`` tokens, so
   the message names that threshold ("at least"), not the real prompt length. Without ``max_tokens`` the output
   budget is 0 here;
3. engine level: a prompt that exactly fills the window leaves no room for one output token.

Usage::

    error = check_length(prompt_tokens=3000, max_tokens=2000, max_model_len=4096)
    if error:
        return 400, error.body()
    max_tokens = resolve_max_tokens(3000, None, 4096)     # 1096: the rest of the window
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LengthError:
    """A rejected request: vLLM's message and the ``param`` its error JSON names."""

    message: str
    param: str | None

    def body(self) -> dict[str, Any]:
        """vLLM's current HTTP 400 JSON for this error."""
        return error_body(self.message, param=self.param)


class ContextLengthExceeded(ValueError):
    """Raised by the engine for a request that does not fit its window; ``str()`` is vLLM's message."""

    def __init__(self, error: LengthError) -> None:
        super().__init__(error.message)
        self.error = error


def error_body(
    message: str, *, type: str = "BadRequestError", param: str | None = None, code: int = 400
) -> dict[str, Any]:
    """vLLM's current error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _with_parameter(message: str, param: str, value: int) -> str:
    """vLLM's ``VLLMValidationError`` appends the offending parameter and value to its message."""
    return f"{message} (parameter={param}, value={value})"


def _output_over_window(max_tokens: int, max_model_len: int, param: str) -> LengthError:
    message = (
        f"{param}={max_tokens} cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
        "Please request fewer output tokens."
    )
    return LengthError(_with_parameter(message, param, max_tokens), param)


def _total_over_window(max_tokens: int, max_model_len: int) -> LengthError:
    threshold = max_model_len - max_tokens + 1
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{max_tokens} output tokens and your prompt contains at least {threshold} input tokens, "
        f"for a total of at least {threshold + max_tokens} tokens. Please reduce the length of the input "
        "prompt or the number of requested output tokens."
    )
    return LengthError(_with_parameter(message, "input_tokens", threshold), "input_tokens")


def _prompt_fills_window(prompt_tokens: int, max_model_len: int) -> LengthError:
    message = (
        f"The decoder prompt (length {prompt_tokens}) plus the number of requested output tokens (at least 1) "
        f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no "
        "smaller than the number of text tokens (prompt + requested output tokens)."
    )
    return LengthError(message, None)


def check_length(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, param: str = "max_tokens"
) -> LengthError | None:
    """The error vLLM returns for this request, or None when it fits; ``param`` names the field sent."""
    requested = max_tokens or 0
    if requested > max_model_len:
        return _output_over_window(requested, max_model_len, param)
    if prompt_tokens > max_model_len - requested:
        return _total_over_window(requested, max_model_len)
    if requested == 0 and prompt_tokens >= max_model_len:
        return _prompt_fills_window(prompt_tokens, max_model_len)
    return None


def resolve_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget: as requested, or (as vLLM does) the rest of the window when not given."""
    return max_tokens if max_tokens else max(0, max_model_len - prompt_tokens)
