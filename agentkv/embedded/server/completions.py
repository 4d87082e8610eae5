"""``/v1/completions`` (the legacy text API), as vLLM's serving_completion: prompts, ``n``, ``echo``, logprobs.

Each prompt (text or token ids) gets ``n`` choices, indexed ``prompt_index * n + i``. With ``echo`` the prompt
text leads the choice's text and, when ``logprobs`` is set, the prompt tokens lead the logprobs (the first one
null), exactly as vLLM lays them out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

from agentkv.embedded.engine import Delta, Generation
from agentkv.embedded.engine.limits import output_over_window, prompt_over_window, resolve_max_tokens
from agentkv.embedded.engine.sampling import SamplingParams
from agentkv.embedded.server import protocol
from agentkv.embedded.server.prompts import compile_constraint, refuse, token_text, tokenize_text
from agentkv.embedded.server.request_errors import RequestError
from agentkv.embedded.server.requests import CompletionRequest
from agentkv.embedded.server.validation import grammar_spec, sampling_params

if TYPE_CHECKING:
    from agentkv.embedded.server.served import Served


@dataclass(frozen=True)
class CompletionPlan:
    """Prompts as token ids, the params of each of their ``n`` choices, and how to present them."""

    ids: protocol.Ids
    prompts: list[list[int]]
    params: list[SamplingParams]
    max_tokens: int
    budgets: list[int]
    """Each prompt's output budget: ``max_tokens`` clamped to what that prompt leaves of the window."""
    cache_salt: str | None
    echo: bool
    logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    details: bool
    token_ids: bool = False
    tokens_as_ids: bool = False
    fingerprint: str | None = None

    @property
    def n(self) -> int:
        return len(self.params)


def plan_completion(served: Served, request: CompletionRequest) -> CompletionPlan:
    """Validate against the served model and decide the sequences (raises RequestError)."""
    engine, window = served.engine, served.max_model_len
    requested = request.max_tokens
    refuse(output_over_window(requested, window))
    prompts = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            prompts.append(tokenize_text(engine, prompt, window, request.add_special_tokens))
        else:
            outside = next((i for i in prompt if not 0 <= i < engine.vocab_size), None)
            if outside is not None:
                raise RequestError(f"Token id {outside} is out of vocabulary")
            refuse(prompt_over_window(len(prompt), window, truncated=False))
            prompts.append(list(prompt))
    if any(not p for p in prompts):
        raise RequestError("The decoder prompt cannot be empty")
    budgets = [resolve_max_tokens(len(p), requested, window) for p in prompts]  # each prompt's own clamp
    max_tokens = min(budgets)
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs
    base = sampling_params(request, max_tokens=max_tokens, vocab_size=engine.vocab_size,
                           max_logprobs=served.options.max_logprobs, logprobs=request.logprobs,
                           prompt_logprobs=prompt_logprobs,
                           grammar=compile_constraint(served, grammar_spec(request)))
    params = [replace(base, seed=base.seed + i) for i in range(request.n or 1)]
    options = request.stream_options
    return CompletionPlan(protocol.Ids(served.model_id, prefix="cmpl"), prompts, params, max(budgets), budgets,
                          request.cache_salt, request.echo, request.logprobs,
                          bool(options and options.include_usage),
                          bool(options and options.include_usage and options.continuous_usage_stats),
                          served.options.enable_prompt_tokens_details, bool(request.return_token_ids),
                          bool(request.return_tokens_as_token_ids),
                          protocol.fingerprint(served.root, served.max_model_len))


def _logprobs(served: Served, plan: CompletionPlan, prompt: list[int], result: Generation,
              echo_text: str) -> dict[str, Any] | None:
    if plan.logprobs is None:
        return None
    text_of = token_text(served, plan.tokens_as_ids)
    if plan.echo and result.prompt_logprobs is not None:
        return protocol.completion_logprobs([*result.prompt_logprobs, *result.logprobs],
                                            [*prompt, *result.token_ids], text_of)
    return protocol.completion_logprobs(result.logprobs, result.token_ids, text_of)


def completion_whole(served: Served, plan: CompletionPlan, abort: threading.Event) -> dict[str, Any]:
    """Run every choice of every prompt and build the ``text_completion``."""
    engine = served.engine
    choices, completion_tokens, cached = [], 0, 0
    for p_index, prompt in enumerate(plan.prompts):
        echo_text = engine.decode(prompt) if plan.echo else ""
        for i, params in enumerate(plan.params):
            params = replace(params, max_tokens=plan.budgets[p_index])
            result = engine.generate(prompt, params=params, cache_salt=plan.cache_salt, abort=abort)
            completion_tokens += result.completion_tokens
            cached += result.cached_tokens if i == 0 else 0
            choice = protocol.text_choice(
                p_index * plan.n + i, echo_text + result.text, result.finish_reason, result.stop_reason,
                _logprobs(served, plan, prompt, result, echo_text),
                protocol.prompt_logprobs(result.prompt_logprobs, token_text(served, plan.tokens_as_ids)))
            if plan.token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(prompt), list(result.token_ids)
            choices.append(choice)
    prompt_tokens = sum(len(p) for p in plan.prompts) * 1
    usage = protocol.usage(prompt_tokens, completion_tokens, cached if plan.details else None, chat=False)
    return protocol.text_completion(plan.ids, choices, usage, plan.fingerprint)


def completion_events(served: Served, plan: CompletionPlan, abort: threading.Event) -> Iterator[bytes]:
    """The SSE body: text chunks per choice (the last with finish_reason), the usage chunk if asked, ``[DONE]``."""
    engine = served.engine
    text_of = token_text(served, plan.tokens_as_ids)
    completion_tokens, cached = 0, 0
    for p_index, prompt in enumerate(plan.prompts):
        for i, params in enumerate(plan.params):
            index = p_index * plan.n + i
            params = replace(params, max_tokens=plan.budgets[p_index])
            stream = engine.stream(prompt, params=params, cache_salt=plan.cache_salt, abort=abort)
            try:
                lead = engine.decode(prompt) if plan.echo else ""
                first = True
                pending: Delta | None = None
                tokens = 0
                for item in stream:
                    if isinstance(item, Generation):
                        completion_tokens += item.completion_tokens
                        cached += item.cached_tokens if i == 0 else 0
                        text = lead + (pending.text if pending else "")
                        yield protocol.sse(_with_ids(plan, protocol.text_chunk(
                            plan.ids, index, text, finish_reason=item.finish_reason, stop_reason=item.stop_reason,
                            logprobs=_delta_logprobs(plan, pending, text_of),
                            usage_=_continuous(plan, len(prompt), tokens),
                            system_fingerprint=None if plan.include_usage else plan.fingerprint),
                            prompt if first else None, pending))
                        break
                    if pending is not None and (pending.text or lead or plan.token_ids):
                        yield protocol.sse(_with_ids(plan, protocol.text_chunk(
                            plan.ids, index, lead + pending.text, logprobs=_delta_logprobs(plan, pending, text_of),
                            usage_=_continuous(plan, len(prompt), tokens)), prompt if first else None, pending))
                        lead, first = "", False
                    pending = item
                    tokens += 1
            finally:
                stream.close()  # type: ignore[attr-defined]
    if plan.include_usage:
        usage = protocol.usage(sum(len(p) for p in plan.prompts), completion_tokens,
                               cached if plan.details else None, chat=False)
        yield protocol.sse(protocol.usage_chunk(plan.ids, usage, "text_completion", plan.fingerprint))
    yield protocol.sse("[DONE]")


def _with_ids(plan: CompletionPlan, chunk: dict[str, Any], prompt: list[int] | None,
              delta: Delta | None) -> dict[str, Any]:
    """Add ``prompt_token_ids`` (first chunk) and ``token_ids`` when the request asked for them."""
    if plan.token_ids:
        choice = chunk["choices"][0]
        if prompt is not None:
            choice["prompt_token_ids"] = list(prompt)
        choice["token_ids"] = [delta.token_id] if delta is not None and delta.token_id is not None else []
    return chunk


def _delta_logprobs(plan: CompletionPlan, delta: Delta | None, text_of: protocol.TokenText) -> dict[str, Any] | None:
    if plan.logprobs is None or delta is None or delta.token_id is None:
        return None
    return protocol.completion_logprobs([delta.logprob], [delta.token_id], text_of)


def _continuous(plan: CompletionPlan, prompt_tokens: int, tokens: int) -> dict[str, Any] | None:
    return protocol.usage(prompt_tokens, tokens, None) if plan.continuous_usage else None
