"""Recognise a context-overflow error and parse the server's numbers out of it (pure functions).

Every vLLM wording is handled; each yields an :class:`Overflow` that says which numbers are real
prompt lengths and which are only thresholds. The "at least" figures are thresholds: 0.2x-0.31's "at least
L-M+1 input tokens" (clamping ``max_tokens`` to ``L - threshold`` gives ``M - 1`` and loops forever) and
0.32's "at least L+1 input tokens, which exceeds this limit even without any output tokens" (the
tokenizer stopped at L+1). They are reported with ``prompt_is_lower_bound=True`` and the driver must get
a real count or escalate; the window L they state is real, and the Session learns it.

Hosted providers' wordings are read too: Anthropic's ``prompt is too long: {n} tokens > {L} maximum``, OpenAI's
``maximum context length is {L} tokens. However, your messages resulted in {n} tokens``, and Gemini's ``The input
token count ({n}) exceeds the maximum number of tokens allowed ({L})``.

vLLM 0.32's wordings (``vllm/renderers/params.py``), each read here:

- prompt alone over the window: ``This model's maximum context length is {L} tokens. However, your prompt
  contains at least {L+1} input tokens, which exceeds this limit even without any output tokens. ...``
  (without "at least", and with the exact length, when the prompt came as token ids);
- the character pre-check, before tokenising: ``This model's maximum context length is {L} tokens. However,
  your prompt contains {n} characters (more than {m} characters, which is the upper bound for {L} input
  tokens). ...``;
- an output budget over the window: ``max_tokens={M} cannot be greater than max_model_len={L}. Please
  request fewer output tokens.``, the same with ``max_completion_tokens=`` (and ``max_output_tokens=`` on
  the Responses API).

The parser is total and linear-time on hostile text: it reads at most :data:`SCAN_LIMIT` characters
(the head and the tail of a longer text), every number is at most :data:`MAX_NUMBER_CHARS` characters
(a longer digit run matches no wording, so ``int()`` never sees more digits than it accepts), and no
pattern has an unbounded gap, so each match attempt does bounded work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["MAX_NUMBER_CHARS", "SCAN_LIMIT", "Overflow", "error_text", "overflow_from_error", "parse_overflow", "scanned"]

SCAN_LIMIT = 65_536
"""Characters of error text the parser reads: the first and last half of a longer text."""
MAX_NUMBER_CHARS = 18
"""Longest digit run (commas included) read as a number; a longer one is no token count."""
_INT = rf"(\d[\d,]{{0,{MAX_NUMBER_CHARS - 1}}})(?![\d,])"
_GAP = r".{0,200}?"  # bounded and without re.S: each attempt is O(1), and it never spans the scan seam


@dataclass(frozen=True)
class Overflow:
    """What an overflow error said.

    ``max_context`` is the server's window as it reported it (None where the wording gives no
    trustworthy window); ``prompt_tokens`` is the prompt length the server gave, exact unless
    ``prompt_is_lower_bound``; ``requested_output`` is the output budget it saw, when stated.
    """

    variant: str
    max_context: int | None
    prompt_tokens: int | None
    requested_output: int | None = None
    prompt_is_lower_bound: bool = False

    def room_for_output(self, real_prompt_tokens: int | None = None) -> int | None:
        """Tokens of output that fit, given an exact prompt count (or the server's, when exact)."""
        prompt = real_prompt_tokens
        if prompt is None and not self.prompt_is_lower_bound:
            prompt = self.prompt_tokens
        if prompt is None or self.max_context is None:
            return None
        return self.max_context - prompt


def _n(text: str) -> int:
    return int(text.replace(",", ""))


def _messages_and_completion(m: re.Match[str]) -> Overflow:
    return Overflow("messages_and_completion", _n(m[1]), _n(m[3]), _n(m[4]))


def _max_tokens_too_large(m: re.Match[str]) -> Overflow:
    return Overflow("max_tokens_too_large", _n(m[2]), _n(m[3]), _n(m[1]))


def _at_least(m: re.Match[str]) -> Overflow:
    return Overflow("at_least", _n(m[1]), _n(m[3]), _n(m[2]), prompt_is_lower_bound=True)


def _input_only(m: re.Match[str]) -> Overflow:
    # Some releases reported max_model_len - max_tokens as the "maximum context length": not trusted.
    return Overflow("input_tokens", None, _n(m[2]))


def _decoder_prompt(m: re.Match[str]) -> Overflow:
    return Overflow("decoder_prompt", _n(m[2]), _n(m[1]))


def _max_tokens_over_window(m: re.Match[str]) -> Overflow:
    # max_tokens alone exceeds the window: the message states no prompt length.
    return Overflow("max_tokens_over_window", _n(m[2]), None, _n(m[1]))


def _prompt_too_long(m: re.Match[str]) -> Overflow:
    return Overflow("prompt_too_long", _n(m[2]), _n(m[1]))


def _prompt_over_window(m: re.Match[str]) -> Overflow:
    # 0.32: "at least L+1" when the tokenizer stopped at L+1 (a threshold); the exact length otherwise.
    return Overflow("prompt_over_window", _n(m[1]), _n(m[3]), prompt_is_lower_bound=bool(m[2]))


def _anthropic_too_long(m: re.Match[str]) -> Overflow:
    # Anthropic: "prompt is too long: {n} tokens > {L} maximum" (the prompt counted whole, the window exact)
    return Overflow("anthropic_prompt_too_long", _n(m[2]), _n(m[1]))


def _openai_messages(m: re.Match[str]) -> Overflow:
    # OpenAI: "maximum context length is {L} tokens. However, your messages resulted in {n} tokens"
    return Overflow("openai_messages", _n(m[1]), _n(m[2]))


def _gemini_input(m: re.Match[str]) -> Overflow:
    # Gemini: "The input token count ({n}) exceeds the maximum number of tokens allowed ({L})"
    return Overflow("gemini_input", _n(m[2]), _n(m[1]))


def _prompt_characters(m: re.Match[str]) -> Overflow:
    # Refused before tokenising: more characters than L tokens can hold, so the prompt has more than L tokens.
    window, chars, limit = _n(m[1]), _n(m[2]), _n(m[3])
    per_token = limit // window if window else 0
    at_least = max(window + 1, -(-chars // per_token) if per_token else 0)
    return Overflow("prompt_characters", window, at_least, prompt_is_lower_bound=True)


_PATTERNS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], Overflow]], ...] = (
    (
        re.compile(
            rf"maximum context length is {_INT} tokens\. However, you requested {_INT} tokens "
            rf"\({_INT} in the messages, {_INT} in the completion\)"
        ),
        _messages_and_completion,
    ),
    (
        re.compile(
            rf"'max_tokens' or 'max_completion_tokens' is too large: {_INT}\. This model's maximum "
            rf"context length is {_INT} tokens and your request has {_INT} input tokens"
        ),
        _max_tokens_too_large,
    ),
    (
        re.compile(
            rf"maximum context length is {_INT} tokens\. However, you requested {_INT} output tokens "
            rf"and your prompt contains at least {_INT} input tokens"
        ),
        _at_least,
    ),
    (
        re.compile(rf"maximum context length is {_INT} tokens\. However, your request has {_INT} input tokens"),
        _input_only,
    ),
    (
        re.compile(rf"maximum context length is {_INT} tokens\. However, your prompt contains (at least )?{_INT} "
                   rf"input tokens, which exceeds this limit even without any output tokens"),
        _prompt_over_window,
    ),
    (
        re.compile(rf"maximum context length is {_INT} tokens\. However, your prompt contains {_INT} characters "
                   rf"\(more than {_INT} characters"),
        _prompt_characters,
    ),
    (
        re.compile(
            rf"decoder prompt \(length {_INT}\) plus the number of requested output tokens{_GAP}"
            rf"maximum model length of {_INT}"
        ),
        _decoder_prompt,
    ),
    (
        re.compile(rf"max_(?:completion_|output_)?tokens={_INT} cannot be greater than "
                   rf"max_model_len(?:=max_total_tokens)?={_INT}"),
        _max_tokens_over_window,
    ),
    (
        re.compile(rf"prompt \(total length {_INT}\) is too long to fit into the model \(context length {_INT}\)"),
        _prompt_too_long,
    ),
    (re.compile(rf"prompt is too long: {_INT} tokens > {_INT} maximum"), _anthropic_too_long),
    (re.compile(rf"maximum context length is {_INT} tokens\. However, your messages resulted in {_INT} tokens"),
     _openai_messages),
    (re.compile(rf"input token count \({_INT}\) exceeds the maximum number of tokens allowed \({_INT}\)"),
     _gemini_input),
)

_GENERIC = re.compile(
    r"context[ _-]?(length|window)[ _-]?exceeded|maximum context length|too long to fit|"
    r"maximum model length|prompt is too long|reduce the length|cannot be greater than max_model_len|"
    r"exceeds the maximum number of tokens allowed",
    re.I,
)


def parse_overflow(text: str) -> Overflow | None:
    """The overflow the error text describes, or None when it is not a context overflow.

    Total: any string gives an :class:`Overflow` or None, in time linear in ``min(len(text), SCAN_LIMIT)``.
    """
    text = scanned(text)
    for pattern, build in _PATTERNS:
        match = pattern.search(text)
        if match:
            return build(match)
    if _GENERIC.search(text):
        return Overflow("unparsed", None, None)
    return None


def scanned(text: str) -> str:
    """The part of ``text`` the parser reads: all of it, or its head and tail around a line break."""
    if len(text) <= SCAN_LIMIT:
        return text
    half = SCAN_LIMIT // 2
    return f"{text[:half]}\n{text[-half:]}"


def error_text(error: BaseException) -> str:
    """All the text an exception carries: litellm keeps the server's JSON only inside ``str(e)``."""
    parts = [str(error), str(getattr(error, "message", "") or "")]
    body = getattr(error, "body", None)
    if body:
        parts.append(str(body))
    return "\n".join(parts)


def _status_code(error: BaseException) -> int | None:
    code = getattr(error, "status_code", None)
    return code if isinstance(code, int) else None


def overflow_from_error(error: BaseException) -> Overflow | None:
    """The overflow behind a litellm/HTTP error, or None for any other error.

    A ``ContextWindowExceededError`` always counts; any other error counts only when it is a 400 whose
    text is a recognised overflow wording.
    """
    is_cwe = type(error).__name__ == "ContextWindowExceededError"
    if not is_cwe and _status_code(error) not in (400, 413, None):
        return None
    found = parse_overflow(error_text(error))
    if found is None and is_cwe:
        return Overflow("unparsed", None, None)
    if found is not None and not is_cwe and _status_code(error) is None and not _is_bad_request(error):
        return None
    return found


def _is_bad_request(error: Any) -> bool:
    return any(cls.__name__ == "BadRequestError" for cls in type(error).__mro__)
