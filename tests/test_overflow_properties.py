"""Property tests: parse_overflow is total, reads any wrapped wording exactly, and stays fast on hostile text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.overflow import MAX_NUMBER_CHARS, SCAN_LIMIT, Overflow, overflow_from_error, parse_overflow

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Each wording as vLLM writes it, with the Overflow it must give for numbers (L, P, M).
WORDINGS: dict[str, tuple[str, Callable[[int, int, int], Overflow]]] = {
    "messages_and_completion": (
        "This model's maximum context length is {L} tokens. However, you requested {T} tokens ({P} in the "
        "messages, {M} in the completion). Please reduce the length of the messages or completion.",
        lambda L, P, M: Overflow("messages_and_completion", L, P, M),
    ),
    "max_tokens_too_large": (
        "'max_tokens' or 'max_completion_tokens' is too large: {M}. This model's maximum context length is {L} "
        "tokens and your request has {P} input tokens ({M} > {L} - {P}).",
        lambda L, P, M: Overflow("max_tokens_too_large", L, P, M),
    ),
    "at_least": (
        "This model's maximum context length is {L} tokens. However, you requested {M} output tokens and your "
        "prompt contains at least {P} input tokens, for a total of at least {T} tokens. Please reduce the length "
        "of the input prompt or the number of requested output tokens. (parameter=input_tokens, value={P})",
        lambda L, P, M: Overflow("at_least", L, P, M, prompt_is_lower_bound=True),
    ),
    "input_tokens": (
        "This model's maximum context length is {L} tokens. However, your request has {P} input tokens. "
        "Please reduce the length of the input messages. (parameter=input_tokens, value={P})",
        lambda L, P, M: Overflow("input_tokens", None, P),
    ),
    "decoder_prompt": (
        "The decoder prompt (length {P}) plus the number of requested output tokens (at least 1) is longer than "
        "the maximum model length of {L}. Make sure that `max_model_len` is no smaller than the number of text tokens.",
        lambda L, P, M: Overflow("decoder_prompt", L, P),
    ),
    "max_tokens_over_window": (
        "max_tokens={M} cannot be greater than max_model_len=max_total_tokens={L}. "
        "Please request fewer output tokens. (parameter=max_tokens, value={M})",
        lambda L, P, M: Overflow("max_tokens_over_window", L, None, M),
    ),
    "prompt_over_window": (
        "This model's maximum context length is {L} tokens. However, your prompt contains at least {P} input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value={P})",
        lambda L, P, M: Overflow("prompt_over_window", L, P, prompt_is_lower_bound=True),
    ),
    "prompt_over_window_exact": (
        "This model's maximum context length is {L} tokens. However, your prompt contains {P} input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value={P})",
        lambda L, P, M: Overflow("prompt_over_window", L, P),
    ),
    "max_completion_tokens_over_window": (
        "max_completion_tokens={M} cannot be greater than max_model_len={L}. Please request fewer output tokens. "
        "(parameter=max_completion_tokens, value={M})",
        lambda L, P, M: Overflow("max_tokens_over_window", L, None, M),
    ),
    "prompt_too_long": (
        "The prompt (total length {P}) is too long to fit into the model (context length {L}).",
        lambda L, P, M: Overflow("prompt_too_long", L, P),
    ),
}

# Fragments of the wordings, digit runs and wrapper punctuation: random soups of these come close to
# matching, which is where a backtracking or int() failure would hide.
FRAGMENTS = sorted({word for text, _ in WORDINGS.values() for word in text.replace("{", " {").split()
                    if "{" not in word}) + ["(", ")", ",", "=", ".", "\n", '\\"', '"', "{", "}", " "]

tokens = st.integers(min_value=0, max_value=10**12)
digit_runs = st.integers(min_value=1, max_value=6_000).map(lambda n: "9" * n)
soups = st.lists(st.one_of(st.sampled_from(FRAGMENTS), digit_runs.map(lambda d: d[:40]),
                           st.integers(0, 10**6).map(str)), max_size=80).map(" ".join)
noise = st.text(alphabet=st.characters(blacklist_categories=("Nd",)), max_size=200)


def litellm_string(message: str) -> str:
    """How litellm's BadRequestError renders a vLLM error body."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    return f"litellm.BadRequestError: Hosted_vllmException - {body}"


WRAPPERS: tuple[Callable[[str], str], ...] = (
    lambda m: m,
    litellm_string,
    lambda m: json.dumps({"object": "error", "message": m, "code": 400}),
    lambda m: litellm_string(json.dumps({"detail": m})),
)


def _check_shape(found: Overflow | None) -> None:
    if found is not None:
        for value in (found.max_context, found.prompt_tokens, found.requested_output):
            assert value is None or (isinstance(value, int) and 0 <= value < 10**MAX_NUMBER_CHARS)


@PROPERTY
@given(st.text(max_size=2_000))
def test_any_text_gives_an_overflow_or_none(text: str) -> None:
    """Arbitrary unicode text never raises and gives None or a well-formed Overflow."""
    _check_shape(parse_overflow(text))


@PROPERTY
@given(soups, st.sampled_from(WRAPPERS))
def test_near_miss_wording_soups_never_raise(soup: str, wrap: Callable[[str], str]) -> None:
    """Shuffled wording fragments and digit runs, bare or in JSON/litellm wrappers, never raise."""
    _check_shape(parse_overflow(wrap(soup)))


@PROPERTY
@given(st.sampled_from(sorted(WORDINGS)), tokens, tokens, tokens, st.booleans(),
       st.sampled_from(WRAPPERS), noise, noise)
def test_every_wording_parses_exactly_wherever_it_is_wrapped(
    variant: str, L: int, P: int, M: int, commas: bool, wrap: Callable[[str], str], before: str, after: str
) -> None:
    """Each wording with any token counts (commas or not), wrapped and surrounded by noise, gives its exact numbers."""
    template, expected = WORDINGS[variant]
    fmt = "{:,}" if commas else "{}"
    message = template.format(L=fmt.format(L), P=fmt.format(P), M=fmt.format(M), T=fmt.format(P + M))
    assert parse_overflow(before + " " + wrap(message) + " " + after) == expected(L, P, M)


@PROPERTY
@given(st.sampled_from(sorted(WORDINGS)), st.sampled_from("LPM"), st.integers(MAX_NUMBER_CHARS + 1, 20_000),
       st.sampled_from(WRAPPERS))
def test_numbers_too_long_to_be_token_counts_never_raise(
    variant: str, field: str, digits: int, wrap: Callable[[str], str]
) -> None:
    """A number of any length up to 20,000 digits (CPython's int() refuses 4,301) gives no ValueError and no giant count."""
    numbers = {"L": "16384", "P": "12304", "M": "4096", "T": "16400", field: "7" * digits}
    found = parse_overflow(wrap(WORDINGS[variant][0].format(**numbers)))
    _check_shape(found)


def test_a_4301_digit_prompt_length_is_unparsed_not_an_exception() -> None:
    """The 4,301-digit prompt length that raised ValueError now reads as an overflow with no numbers."""
    text = "This model's maximum context length is 16384 tokens. However, your request has " + "7" * 4_301 + " input tokens."
    assert parse_overflow(text) == Overflow("unparsed", None, None)


class BadRequestError(Exception):
    status_code = 400


@PROPERTY
@given(st.one_of(soups, st.text(max_size=500)),
       st.one_of(st.none(), soups, st.dictionaries(st.text(max_size=5), soups, max_size=3)))
def test_overflow_from_error_is_total(message: str, body: object) -> None:
    """Any 400 error with any message and body gives None or an Overflow, never an exception."""
    error = BadRequestError(message)
    error.body = body  # type: ignore[attr-defined]
    _check_shape(overflow_from_error(error))


_HOSTILE_PARSE = """
from agentkv.overflow import parse_overflow
unit = "The decoder prompt (length 17000) plus the number of requested output tokens "
for size in (400_000, 4_000_000):
    parse_overflow(unit * (size // len(unit)))
parse_overflow("This model's maximum context length is 16384 tokens. However, you requested " * 50_000)
"""


def test_megabytes_of_repeated_wording_parse_without_hanging() -> None:
    """400 KB and 4 MB of repeated near-miss wording (hours for a quadratic `.*?` pattern) parse to the end.

    In a child process: a regex holds the GIL, so a thread could not stop it, and a hang must fail, not stall.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        done = subprocess.run([sys.executable, "-c", _HOSTILE_PARSE], env=env, timeout=120, capture_output=True)
    except subprocess.TimeoutExpired:
        pytest.fail("parse_overflow did not finish on megabytes of repeated wording")
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_wording_past_the_scan_limit_is_still_found_in_the_tail() -> None:
    """A long text is read head and tail: a wording at its end is parsed, one buried in the middle is not."""
    filler = "x" * (SCAN_LIMIT * 2)
    wording = "The prompt (total length 17000) is too long to fit into the model (context length 16384)."
    assert parse_overflow(filler + wording) == Overflow("prompt_too_long", 16384, 17000)
    assert parse_overflow(filler + wording + filler) is None


CHARACTERS = ("This model's maximum context length is {L} tokens. However, your prompt contains {n} characters (more "
              "than {m} characters, which is the upper bound for {L} input tokens). Please reduce the length of the "
              "input prompt. (parameter=input_text, value={n})")


@PROPERTY
@given(st.integers(1, 10**7), st.integers(1, 512), st.integers(1, 10**9), st.sampled_from(WRAPPERS))
def test_character_pre_check_bounds_the_prompt_from_below(L: int, per_token: int, extra: int,
                                                          wrap: Callable[[str], str]) -> None:
    """vLLM 0.32's character check (n > m = L * chars-per-token) reads as L and a lower bound of ceil(n / chars-per-token) > L."""
    n, m = L * per_token + extra, L * per_token
    found = parse_overflow(wrap(CHARACTERS.format(L=L, n=n, m=m)))
    assert found == Overflow("prompt_characters", L, -(-n // per_token), prompt_is_lower_bound=True)
    assert found.prompt_tokens is not None and found.prompt_tokens > L
