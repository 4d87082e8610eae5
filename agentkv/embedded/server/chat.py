"""``/v1/chat/completions`` from a validated request to response objects or SSE chunks, as vLLM's serving_chat.

:func:`plan_chat` decides everything before the model runs (prompt tokens, length check, one
:class:`SamplingParams` per choice with seeds ``seed + i``, the grammar, echo text); :func:`chat_whole` and
:func:`chat_events` run the plan on the engine. In a stream the last text of a choice travels with its
``finish_reason``; with tools the text is parsed (``auto``), constrained to a JSON array of calls
(``required``) or to one function's arguments (a named function), and sent as ``tool_calls`` deltas.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generator, Iterator, Sequence

from agentkv.embedded.engine import Delta, Generation
from agentkv.embedded.engine.codec import ChatRequest
from agentkv.embedded.engine.limits import output_over_window, resolve_max_tokens
from agentkv.embedded.engine.sampling import SamplingParams
from agentkv.embedded.server import protocol, tools
from agentkv.embedded.server.prompts import compile_constraint, refuse, token_text, tokenize_text
from agentkv.embedded.server.request_errors import RequestError
from agentkv.embedded.server.requests import ChatCompletionRequest
from agentkv.embedded.server.validation import grammar_spec, sampling_params

if TYPE_CHECKING:
    from agentkv.embedded.server.served import Served

_TAG = "<tool_call>"


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request will run: the prompt, one params per choice, and how to present the output."""

    ids: protocol.Ids
    tokens: list[int]
    params: list[SamplingParams]
    max_tokens: int
    cache_salt: str | None
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    echo: str
    logprobs: bool
    include_usage: bool
    continuous_usage: bool
    details: bool
    token_ids: bool = False
    tokens_as_ids: bool = False
    block_size: int = 16
    fingerprint: str | None = None

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def tool_mode(self) -> str:
        """plain, parse (auto), required or named: how output becomes content or tool calls."""
        if not self.tools or self.tool_choice == "none":
            return "plain"
        if self.tool_choice == "auto":
            return "parse"
        return "required" if self.tool_choice == "required" else "named"


def _echo_text(request: ChatCompletionRequest) -> str:
    """With ``echo``, the final message's text when it is the assistant's (what vLLM prepends)."""
    if not request.echo or not request.messages or request.messages[-1].role != "assistant":
        return ""
    content = request.messages[-1].content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content)
    return content or ""


def plan_chat(served: Served, request: ChatCompletionRequest) -> ChatPlan:
    """Validate against the served model and decide the request's sequences (raises RequestError)."""
    engine = served.engine
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    tool_list = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
    choice = request.tool_choice
    tool_choice = choice if choice is None or isinstance(choice, str) else choice.model_dump()
    requested, param = request.output_budget()
    refuse(output_over_window(requested, served.max_model_len, param))
    if not messages:
        raise RequestError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = ChatRequest(messages, tool_list, tool_choice, request.add_generation_prompt,
                       request.continue_final_message, dict(request.chat_template_kwargs or {}))
    tokens = tokenize_text(engine, engine.codec.render(chat), served.max_model_len, request.add_special_tokens)
    max_tokens = resolve_max_tokens(len(tokens), requested, served.max_model_len)
    spec = grammar_spec(request)
    forced = tools.forced_tool_spec(tool_list, tool_choice, bool(request.parallel_tool_calls))
    if spec is not None and forced is not None and tool_choice != "required":
        raise RequestError("You can only either use constraints for structured outputs or tools, not both.")
    logprobs = request.top_logprobs if request.logprobs else None
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.top_logprobs
    base = sampling_params(request, max_tokens=max_tokens, vocab_size=engine.vocab_size,
                           max_logprobs=served.options.max_logprobs, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs, grammar=compile_constraint(served, spec or forced))
    seed = base.seed if base.seed is not None else 0  # sampling_params always draws one
    params = [replace(base, seed=seed + i, prompt_logprobs=prompt_logprobs if i == 0 else None)
              for i in range(request.n or 1)]
    options = request.stream_options
    return ChatPlan(protocol.Ids(served.model_id), tokens, params, max_tokens, request.cache_salt, tool_list,
                    tool_choice, _echo_text(request), bool(request.logprobs),
                    bool(options and options.include_usage),
                    bool(options and options.include_usage and options.continuous_usage_stats),
                    served.options.enable_prompt_tokens_details, bool(request.return_token_ids),
                    bool(request.return_tokens_as_token_ids), engine.prefix_cache.block_size,
                    protocol.fingerprint(served.root, served.max_model_len))


def _usage(plan: ChatPlan, completion_tokens: int, cached: int) -> dict[str, Any]:
    created = protocol.created_cache_tokens(len(plan.tokens), cached, plan.block_size)
    return protocol.usage(len(plan.tokens), completion_tokens, cached if plan.details else None, created)


def chat_whole(served: Served, plan: ChatPlan, abort: threading.Event) -> dict[str, Any]:
    """Run every choice to the end and build the ``chat.completion``."""
    engine = served.engine
    results = [engine.generate(plan.tokens, params=p, cache_salt=plan.cache_salt, abort=abort)
               for p in plan.params]
    text_of = token_text(served, plan.tokens_as_ids)
    choices = []
    for index, result in enumerate(results):
        finish = result.finish_reason
        content, calls = tools.tool_calls_from_output(result.text, plan.tools, plan.tool_choice, finish)
        if calls and plan.tool_mode in ("parse", "required"):
            finish = "tool_calls"
        if plan.echo and not calls:
            content = plan.echo + (content or "")
        logprobs = protocol.chat_logprobs(result.logprobs, text_of) if plan.logprobs else None
        choice = protocol.chat_choice(index, protocol.message(content, calls), finish, result.stop_reason, logprobs)
        if plan.token_ids:
            choice["token_ids"] = list(result.token_ids)
        choices.append(choice)
    usage = _usage(plan, sum(r.completion_tokens for r in results), results[0].cached_tokens)
    prompt_lps = protocol.prompt_logprobs(results[0].prompt_logprobs, text_of)
    response = protocol.chat_completion(plan.ids, choices, usage, prompt_lps, plan.fingerprint)
    if plan.token_ids:
        response["prompt_token_ids"] = list(plan.tokens)
    return response


class _Choice:
    """Turns one choice's engine items into chunk deltas; the last delta waits for the finish."""

    def __init__(self, index: int, plan: ChatPlan, text_of: protocol.TokenText) -> None:
        self.index, self.plan, self.text_of = index, plan, text_of
        self.pending: Delta | None = None
        self.tokens = 0
        self.text = ""
        self.sent = 0
        self.named_started = False

    def feed(self, item: Delta | Generation) -> list[tuple[dict[str, Any], dict[str, Any] | None, Any, Any, list[int]]]:
        """(delta, logprobs, finish_reason, stop_reason, token_ids) for each chunk this item releases."""
        if isinstance(item, Delta):
            out = self._release(self.pending, final=False) if self.pending is not None else []
            self.pending = item
            return out
        return self._release(self.pending, final=True, result=item)

    def _release(self, delta: Delta | None, *, final: bool, result: Generation | None = None) -> list[Any]:
        chunks = self._chunks(delta, final=final, result=result)
        if chunks and delta is not None and delta.token_id is not None:
            chunks[-1] = (*chunks[-1][:4], [delta.token_id])
        return [c if len(c) == 5 else (*c, []) for c in chunks]

    def _chunks(self, delta: Delta | None, *, final: bool, result: Generation | None = None) -> list[Any]:
        text = delta.text if delta is not None else ""
        if delta is not None and delta.token_id is not None:
            self.tokens += 1
        logprobs = None
        if self.plan.logprobs and delta is not None and delta.logprob is not None:
            logprobs = protocol.chat_logprobs([delta.logprob], self.text_of)
        self.text += text
        finish = stop = None
        if final and result is not None:
            finish, stop = result.finish_reason, result.stop_reason
        mode = self.plan.tool_mode
        if mode == "plain":
            if not text and logprobs is None and not final:
                return []
            return [({"content": text}, logprobs, finish, stop)]
        if mode == "named":
            return self._named(text, logprobs, final, finish, stop)
        return self._buffered(logprobs, final, finish, stop)

    def _named(self, text: str, logprobs: Any, final: bool, finish: Any, stop: Any) -> list[Any]:
        if not text and not final:
            return []
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not self.named_started:
            self.named_started = True
            call = tools.call(tools.named_function(self.plan.tool_choice) or "", text)
            entry = {"index": 0, "id": call["id"], "type": "function", "function": call["function"]}
        return [({"tool_calls": [entry]}, logprobs, finish, stop)]

    def _buffered(self, logprobs: Any, final: bool, finish: Any, stop: Any) -> list[Any]:
        if not final:
            if self.plan.tool_mode == "required":
                return []
            safe = self._safe_end()
            part = self.text[self.sent:safe]
            self.sent = max(self.sent, safe)
            return [({"content": part}, logprobs, None, None)] if part else []
        content, calls = tools.tool_calls_from_output(self.text, self.plan.tools, self.plan.tool_choice,
                                                      finish or "stop")
        if not calls:
            rest = self.text[self.sent:]
            return [({"content": rest}, logprobs, finish, stop)]
        out: list[Any] = []
        lead = (content or "")[self.sent:] if self.plan.tool_mode == "parse" else ""
        if lead:
            out.append(({"content": lead}, None, None, None))
        deltas = [{"index": i, "id": c["id"], "type": "function", "function": c["function"]}
                  for i, c in enumerate(calls)]
        out.append(({"tool_calls": deltas}, logprobs, "tool_calls", stop))
        return out

    def _safe_end(self) -> int:
        """How much text can be sent without possibly splitting a ``<tool_call>`` tag."""
        found = self.text.find(_TAG)
        if found >= 0:
            return found
        for keep in range(min(len(_TAG) - 1, len(self.text)), 0, -1):
            if _TAG.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)


def chat_events(served: Served, plan: ChatPlan, abort: threading.Event) -> Iterator[bytes]:
    """The SSE body: role chunks, (echo), content chunks (the last with finish_reason), usage, ``[DONE]``.

    As in vLLM, the first chunk leaves only once the prompt is prefilled and a first token exists, so
    time-to-first-chunk measures prefill. Choices of ``n > 1`` advance in turn.
    """
    engine = served.engine
    streams = [engine.stream(plan.tokens, params=p, cache_salt=plan.cache_salt, abort=abort) for p in plan.params]
    try:
        firsts = [next(s) for s in streams]
        yield from _opening_chunks(plan)
        queues = [_chain(f, s) for f, s in zip(firsts, streams)]
        results = yield from _content_chunks(plan, queues, token_text(served, plan.tokens_as_ids))
        if plan.include_usage:
            total = sum(r.completion_tokens for r in results.values())
            yield protocol.sse(protocol.usage_chunk(plan.ids, _usage(plan, total, results[0].cached_tokens),
                                                    system_fingerprint=plan.fingerprint))
        yield protocol.sse("[DONE]")
    finally:
        _close(streams)


def _opening_chunks(plan: ChatPlan) -> Iterator[bytes]:
    """Each choice's role chunk (the first with the prompt's token ids when asked), then its echo."""
    usage = _usage(plan, 0, 0) if plan.continuous_usage else None
    for i in range(plan.n):
        first = protocol.chat_chunk(plan.ids, i, {"role": "assistant", "content": ""}, usage_=usage, first=True)
        if plan.token_ids and i == 0:
            first["prompt_token_ids"] = list(plan.tokens)
        yield protocol.sse(first)
        if plan.echo:
            yield protocol.sse(protocol.chat_chunk(plan.ids, i, {"content": plan.echo}, usage_=usage))


def _content_chunks(plan: ChatPlan, queues: list[Iterator[Delta | Generation]],
                    text_of: protocol.TokenText) -> Generator[bytes, None, dict[int, Generation]]:
    """The choices' content chunks, the choices advancing in turn; returns each choice's :class:`Generation`."""
    choices = [_Choice(i, plan, text_of) for i in range(plan.n)]
    active = list(range(plan.n))
    results: dict[int, Generation] = {}
    cached = 0
    while active:
        for i in list(active):
            item = next(queues[i])
            if isinstance(item, Generation):
                results[i] = item
                cached = results.get(0, item).cached_tokens
                active.remove(i)
            for released in choices[i].feed(item):
                yield _content_chunk(plan, i, released, choices[i].tokens, cached)
    return results


def _content_chunk(plan: ChatPlan, index: int, released: tuple[dict[str, Any], dict[str, Any] | None, Any, Any,
                                                               list[int]], tokens: int, cached: int) -> bytes:
    """One chunk of choice ``index``: what :meth:`_Choice.feed` released, with per-chunk usage
    (``continuous_usage_stats``: this choice's ``tokens`` so far) and the fingerprint on a last chunk."""
    delta, logprobs, finish, stop, token_ids = released
    terminal = finish is not None and not plan.include_usage
    chunk = protocol.chat_chunk(plan.ids, index, delta, finish_reason=finish, stop_reason=stop,
                                system_fingerprint=plan.fingerprint if terminal else None, logprobs=logprobs,
                                usage_=_usage(plan, tokens, cached) if plan.continuous_usage else None)
    if plan.token_ids:
        chunk["choices"][0]["token_ids"] = token_ids
    return protocol.sse(chunk)


def _close(streams: list[Iterator[Delta | Generation]]) -> None:
    """Close each of the engine's streams that can be closed (the request stops with its stream)."""
    for stream in streams:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


def _chain(first: Delta | Generation, rest: Iterator[Delta | Generation]) -> Iterator[Delta | Generation]:
    yield first
    yield from rest


__all__: Sequence[str] = ["ChatPlan", "chat_events", "chat_whole", "plan_chat"]
