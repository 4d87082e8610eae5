"""The request checks that need the served model, and the engine parameters a valid request asks for.

vLLM makes these checks after parsing, against the loaded model: ``SamplingParams._verify_args`` (ranges of
``n``, ``temperature``, ``top_p``, ``min_tokens``...), the engine's vocabulary checks for ``logit_bias`` and
``stop_token_ids``, and ``--max-logprobs``. Every failure is a :class:`~agentkv.embedded.server.requests.RequestError`
with vLLM's message ``... (parameter=NAME, value=VALUE)``.

Usage::

    params = sampling_params(request, max_tokens=16, vocab_size=100352, max_logprobs=20, logprobs=None,
                             prompt_logprobs=None)
    spec = grammar_spec(request)          # the structured-output constraint, or None
"""

from __future__ import annotations

import math
import random
from typing import Any, Mapping, Sequence

from agentkv.embedded.engine.grammar import GrammarSpec
from agentkv.embedded.server.request_errors import RequestError
from agentkv.embedded.server.requests import SamplingFields
from agentkv.embedded.engine.sampling import SamplingParams

MAX_LOGIT_BIAS = 100.0


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """vLLM's out-of-vocabulary check for ``logit_bias`` and ``stop_token_ids``."""
    invalid = [i for i in ids if i < 0 or i >= vocab_size]
    if invalid:
        raise RequestError(f"token_id(s) {invalid} in {field} contain out-of-vocab token ids. Vocabulary size: "
                           f"{vocab_size} (parameter={field}, value={invalid})", param=field)


def logit_bias(raw: Mapping[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` with integer keys, checked against the vocabulary, values clamped to [-100, 100]."""
    if not raw:
        return {}
    bad = [key for key in raw if not _is_int(key)]
    if bad:
        raise RequestError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad} "
                           f"(parameter=logit_bias, value={bad})", param="logit_bias")
    bias = {int(key): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value))) for key, value in raw.items()}
    check_token_ids(list(bias), vocab_size, "logit_bias")
    return bias


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


_EPS = 1e-5
"""Below this temperature vLLM samples greedily."""


def _verify(request: SamplingFields, max_tokens: int) -> None:
    """vLLM 0.32's ``SamplingParams._verify_args`` for the fields agentkv serves, in its order and wording.

    Only some of vLLM's checks name their parameter (``... (parameter=P, value=V)`` and ``param`` in the JSON);
    the others leave ``param`` null, and so do these.
    """
    temperature, n = request.temperature, request.n if request.n is not None else 1
    checks: list[tuple[bool, str | None, str, Any]] = [
        (n < 1, None, "n must be at least 1, got {}.", n),
        (request.presence_penalty is not None and not -2 <= request.presence_penalty <= 2, None,
         "presence_penalty must be in [-2, 2], got {}.", request.presence_penalty),
        (request.frequency_penalty is not None and not -2 <= request.frequency_penalty <= 2, None,
         "frequency_penalty must be in [-2, 2], got {}.", request.frequency_penalty),
        (request.repetition_penalty is not None and not math.isfinite(request.repetition_penalty), None,
         "repetition_penalty must be a finite number, got {}.", request.repetition_penalty),
        (request.repetition_penalty is not None and request.repetition_penalty <= 0, None,
         "repetition_penalty must be greater than zero, got {}.", request.repetition_penalty),
        (temperature is not None and not math.isfinite(temperature), "temperature",
         "temperature must be a finite number, got {}.", temperature),
        (temperature is not None and temperature < 0, "temperature", "temperature must be non-negative, got {}.",
         temperature),
        (temperature is not None and temperature > 2, "temperature", "temperature must be in [0, 2], got {}.",
         temperature),
        (request.top_p is not None and not 0 < request.top_p <= 1, "top_p", "top_p must be in (0, 1], got {}.",
         request.top_p),
        (request.top_k is not None and request.top_k < -1, None, "top_k must be 0 (disable), or at least 1, got {}.",
         request.top_k),
        (request.min_p is not None and not 0 <= request.min_p <= 1, None, "min_p must be in [0, 1], got {}.",
         request.min_p),
        (max_tokens < 1, "max_tokens", "max_tokens must be at least 1, got {}.", max_tokens),
        (request.min_tokens < 0, None, "min_tokens must be greater than or equal to 0, got {}.", request.min_tokens),
        (request.min_tokens > max_tokens, None,
         f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {{}}.", request.min_tokens),
        (any(s == "" for s in request.stops()), None, "stop cannot contain an empty string.{}", ""),
        (temperature is not None and temperature < _EPS and n > 1, None,
         "n must be 1 when using greedy sampling, got {}.", n),
    ]
    for failed, param, message, value in checks:
        if failed:
            text = message.format(value)
            raise RequestError(f"{text} (parameter={param}, value={value})" if param else text, param=param)


def _check_logprobs(kind: str, count: int | None, vocab_size: int, max_logprobs: int) -> None:
    if count is None:
        return
    wanted = vocab_size if count == -1 else count
    if wanted > max_logprobs:
        param = "logprobs" if kind == "sample" else "prompt_logprobs"
        raise RequestError(f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: "
                           f"{max_logprobs} (parameter={param}, value={wanted})", param=param)


def grammar_spec(request: SamplingFields) -> GrammarSpec | None:
    """The structured-output constraint a request asks for (``structured_outputs`` or ``response_format``)."""
    so = request.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar)):
            if value is not None:
                return GrammarSpec(kind, value)
        if so.json_object:
            return GrammarSpec("json_object")
    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        return GrammarSpec("json_object")
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        return GrammarSpec("json", rf.json_schema.json_schema)
    return None


def sampling_params(request: SamplingFields, *, max_tokens: int, vocab_size: int, max_logprobs: int,
                    logprobs: int | None, prompt_logprobs: int | None, grammar: Any = None,
                    default_temperature: float = 0.0) -> SamplingParams:
    """The engine's :class:`SamplingParams` for one sequence of ``request`` (seed as given, or random)."""
    _verify(request, max_tokens)
    _check_logprobs("sample", logprobs, vocab_size, max_logprobs)
    _check_logprobs("prompt", prompt_logprobs, vocab_size, max_logprobs)
    check_token_ids(request.stop_token_ids or [], vocab_size, "stop_token_ids")
    allowed = request.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise RequestError("allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])",
                               param="allowed_token_ids")
        outside = [i for i in allowed if i < 0 or i >= vocab_size]
        if outside:
            raise RequestError(f"allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, "
                               f"value={outside})", param="allowed_token_ids")
    temperature = request.temperature if request.temperature is not None else default_temperature
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=request.top_p if request.top_p is not None else 1.0,
        top_k=max(0, request.top_k or 0), seed=request.seed if request.seed is not None else random.getrandbits(62),
        min_tokens=request.min_tokens, stop=request.stops(), stop_token_ids=tuple(request.stop_token_ids or ()),
        include_stop_str_in_output=request.include_stop_str_in_output, ignore_eos=request.ignore_eos,
        logit_bias=logit_bias(request.logit_bias, vocab_size), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        grammar=grammar, allowed_token_ids=tuple(allowed) if allowed else None,
    )
