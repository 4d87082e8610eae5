"""Context-window checks that answer exactly as vLLM 0.32 does, as pure functions.

vLLM 0.32 validates a generating request in this order, and so do we:

1. ``max_tokens`` (or ``max_completion_tokens``) larger than the window: ``{param}={M} cannot be greater than
   max_model_len={L}``;
2. the prompt text longer than ``L * max_chars_per_token`` characters (a bound checked before tokenizing);
3. the prompt alone over the window. Text is tokenized with truncation at ``L + 1`` tokens, so the message names
   that threshold ("at least {L+1}"), not the real prompt length; a prompt of token ids gives its real length;
4. the output budget is then clamped **silently** to what is left of the window, ``min(L - P, M)``: prompt plus
   ``max_tokens`` over the window is answered 200 with ``finish_reason: "length"``, no longer a 400. A prompt
   that fills the window leaves 0, which sampling refuses (``max_tokens must be at least 1, got 0.``).

The engine keeps vLLM's engine-level check (a prompt of ``L`` or more tokens leaves no room for one output
token) for callers that bypass the HTTP layer.

Usage::

    error = check_length(prompt_tokens=3000, max_tokens=2000, max_model_len=4096)   # None: 2000 is clamped
    max_tokens = resolve_max_tokens(3000, 2000, 4096)                               # 1096
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
        """vLLM's HTTP 400 JSON for this error."""
        return error_body(self.message, param=self.param)


class ContextLengthExceeded(ValueError):
    """Raised by the engine for a request that does not fit its window; ``str()`` is vLLM's message."""

    def __init__(self, error: LengthError) -> None:
        super().__init__(error.message)
        self.error = error


def error_body(
    message: str, *, type: str = "BadRequestError", param: str | None = None, code: int = 400
) -> dict[str, Any]:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _with_parameter(message: str, param: str, value: int) -> str:
    """vLLM's ``VLLMValidationError`` appends the offending parameter and value to its message."""
    return f"{message} (parameter={param}, value={value})"


def output_over_window(max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> LengthError | None:
    """vLLM's refusal of an output budget larger than the whole window (``param`` names the field sent)."""
    if max_tokens is None or max_tokens <= max_model_len:
        return None
    message = (f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
               "Please request fewer output tokens.")
    return LengthError(_with_parameter(message, param, max_tokens), param)


def text_over_window(chars: int, max_model_len: int, max_chars_per_token: int) -> LengthError | None:
    """vLLM's character pre-check: no text longer than ``L * max_chars_per_token`` can fit ``L`` tokens."""
    bound = max_model_len * max_chars_per_token
    if chars <= bound:
        return None
    message = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
               f"{chars} characters (more than {bound} characters, which is the upper bound for {max_model_len} "
               "input tokens). Please reduce the length of the input prompt.")
    return LengthError(_with_parameter(message, "input_text", chars), "input_text")


def prompt_over_window(prompt_tokens: int, max_model_len: int, *, truncated: bool = True) -> LengthError | None:
    """vLLM's refusal of a prompt longer than the window, even without output tokens.

    ``truncated``: the prompt was text, which vLLM tokenizes only up to ``L + 1`` tokens, so the count it
    reports is that threshold; token ids (``truncated=False``) are reported at their real length.
    """
    if prompt_tokens <= max_model_len:
        return None
    count = min(prompt_tokens, max_model_len + 1) if truncated else prompt_tokens
    qualifier = "at least " if count == max_model_len + 1 else ""
    message = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
               f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
               "Please reduce the length of the input prompt.")
    return LengthError(_with_parameter(message, "input_tokens", count), "input_tokens")


def check_length(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, param: str = "max_tokens",
    truncated: bool = True,
) -> LengthError | None:
    """The window error vLLM 0.32 returns for this request, or None when it is served (its budget clamped)."""
    return output_over_window(max_tokens, max_model_len, param) or \
        prompt_over_window(prompt_tokens, max_model_len, truncated=truncated)


def resolve_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget vLLM samples with: the rest of the window, or less when ``max_tokens`` asks for less.

    Not clamped below: a prompt filling the window gives 0, and a negative request stays negative, for the
    sampling check to refuse with vLLM's ``max_tokens must be at least 1`` message.
    """
    room = max_model_len - prompt_tokens
    return room if max_tokens is None else min(room, max_tokens)


def engine_check(prompt_tokens: int, max_model_len: int) -> LengthError | None:
    """vLLM's engine-level prompt check: over the window, or filling it with no room for one output token."""
    suggestion = "Make sure that `max_model_len` is no smaller than the number of text tokens"
    if prompt_tokens > max_model_len:
        return LengthError(f"The decoder prompt (length {prompt_tokens}) is longer than the maximum model length "
                           f"of {max_model_len}. {suggestion}.", None)
    if prompt_tokens == max_model_len:
        return LengthError(f"The decoder prompt (length {prompt_tokens}) plus the number of requested output "
                           f"tokens (at least 1) is longer than the maximum model length of {max_model_len}. "
                           f"{suggestion} (prompt + requested output tokens).", None)
    return None
