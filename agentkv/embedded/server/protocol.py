"""vLLM's OpenAI-compatible responses as pure functions: completion objects, stream chunks, logprobs, usage.

Nothing here touches a model or a socket; :mod:`agentkv.embedded.server.routes` decides what to send and these build it.
Shapes follow vLLM's ``ChatCompletionResponse``/``CompletionResponse`` and their stream chunks: a message's
``tool_calls`` is left out when there are none (the SDK then reads None), ``stop_reason`` rides with
``finish_reason``, and ``usage.prompt_tokens_details`` is filled only when the server enables it.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Any, Callable, Mapping, Sequence

from agentkv.embedded.server.request_errors import RequestError
from agentkv.embedded.engine.sampling import TokenLogprob

TokenText = Callable[[int], str]
"""One token id's own text (what logprob entries name a token by)."""

MIN_LOGPROB = -9999.0
"""vLLM clamps logprobs to OpenAI's floor, so -inf never reaches JSON."""


@dataclass
class Ids:
    """The identity every response and chunk of one request repeats."""

    model: str
    prefix: str = "chatcmpl"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex}"


def model_not_found(model: str, served: str) -> RequestError:
    """vLLM's 404 for a model id it does not serve."""
    return RequestError(f"The model `{model}` does not exist. Valid aliases: {served}.", status=404,
                        type="NotFoundError", param="model")


def fingerprint(root: str, max_model_len: int) -> str:
    """``system_fingerprint``: the server's version and a digest of what it serves, as vLLM's ``full`` mode."""
    digest = hashlib.sha256(f"{root}|{max_model_len}".encode()).hexdigest()[:8]
    return f"agentkv-{_version()}-{digest}"


@lru_cache(maxsize=1)
def _version() -> str:
    try:
        return metadata.version("agentkv")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def models_list(model_id: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": None, "max_model_len": max_model_len,
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                            "created": created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}
    return {"object": "list", "data": [card]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None,
          created_tokens: int | None = None, *, chat: bool = True) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` None leaves ``prompt_tokens_details`` null (vLLM's default).

    vLLM 0.32's details carry ``cached_tokens``, ``created_cache_tokens`` (prompt tokens this request wrote to
    the prefix cache; reported by the chat endpoint only, null on ``/v1/completions``) and ``multimodal_tokens``
    (null for text); ``completion_tokens_details`` is null without a reasoning parser.
    """
    details = None if cached_tokens is None else {
        "cached_tokens": cached_tokens, "created_cache_tokens": created_tokens if chat else None,
        "multimodal_tokens": None}
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details,
            "completion_tokens_details": None}


def created_cache_tokens(prompt_tokens: int, cached_tokens: int, block_size: int) -> int:
    """Prompt tokens a request computed and stored in the prefix cache: its full blocks less the cached ones."""
    return max(0, prompt_tokens // block_size * block_size - cached_tokens)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _entry(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob | None], token_text: TokenText) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat response: one entry per generated token with its top alternatives."""
    content = []
    for e in entries:
        if e is None:
            continue
        item = _entry(token_text, e.token_id, e.logprob)
        item["top_logprobs"] = [_entry(token_text, i, lp) for i, lp in e.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], token_text: TokenText,
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (``text_offset``, ``token_logprobs``, ``tokens``, ``top_logprobs``).

    ``entries`` may hold None (the first prompt token under ``echo``): its logprob and top list are null.
    """
    out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token_id, e in zip(token_ids, entries):
        text = token_text(token_id)
        out["text_offset"].append(offset)
        offset += len(text)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else _clamp(e.logprob))
        if e is None:
            out["top_logprobs"].append(None)
            continue
        top = {token_text(i): _clamp(lp) for i, lp in e.top}
        top.setdefault(text, _clamp(e.logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(entries: Sequence[TokenLogprob | None] | None, token_text: TokenText
                    ) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(i): {"logprob": _clamp(lp), "rank": rank, "decoded_token": token_text(i)}
                    for rank, (i, lp) in enumerate(e.top, start=1)}
        position[str(e.token_id)] = {"logprob": _clamp(e.logprob), "rank": e.rank,
                                     "decoded_token": token_text(e.token_id)}
        out.append(position)
    return out


def message(content: str | None, tool_calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """An assistant message as vLLM serialises it (``tool_calls`` only when there are some)."""
    out: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                           "audio": None, "function_call": None, "reasoning": None}
    if tool_calls:
        out["tool_calls"] = [dict(c) for c in tool_calls]
    return out


def chat_choice(index: int, message_: Mapping[str, Any], finish_reason: str, stop_reason: int | str | None,
                logprobs: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "message": dict(message_), "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": None, "routed_experts": None}


def chat_completion(ids: Ids, choices: Sequence[Mapping[str, Any]], usage_: Mapping[str, Any],
                    prompt_logprobs_: list[Any] | None = None, system_fingerprint: str | None = None
                    ) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    return {"id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
            "choices": list(choices), "service_tier": None, "system_fingerprint": system_fingerprint,
            "usage": dict(usage_), "prompt_logprobs": prompt_logprobs_, "prompt_token_ids": None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def chat_chunk(ids: Ids, index: int, delta: Mapping[str, Any], *, finish_reason: str | None = None,
               stop_reason: int | str | None = None, logprobs: Mapping[str, Any] | None = None,
               usage_: Mapping[str, Any] | None = None, first: bool = False,
               system_fingerprint: str | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice (``usage`` when continuous usage stats are on).

    As vLLM serialises them: the role chunk (``first``) carries ``prompt_token_ids``/``prompt_text`` at the top,
    the others ``token_ids`` in the choice; ``system_fingerprint`` rides on a terminal chunk when given.
    """
    choice: dict[str, Any] = {"index": index, "delta": dict(delta), "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if not first:
        choice["token_ids"] = None
    out: dict[str, Any] = {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created,
                           "model": ids.model, "choices": [choice]}
    if usage_ is not None:
        out["usage"] = _stream_usage(usage_)
    if first:
        out["prompt_token_ids"], out["prompt_text"] = None, None
    if system_fingerprint is not None:
        out["system_fingerprint"] = system_fingerprint
    return out


def _stream_usage(usage_: Mapping[str, Any]) -> dict[str, Any]:
    """Usage inside a chunk: vLLM serialises it without null fields, at every level."""
    return {k: _stream_usage(v) if isinstance(v, Mapping) else v for k, v in usage_.items() if v is not None}


def usage_chunk(ids: Ids, usage_: Mapping[str, Any], object_: str = "chat.completion.chunk",
                system_fingerprint: str | None = None) -> dict[str, Any]:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, only usage (and the fingerprint)."""
    out = {"id": ids.id, "object": object_, "created": ids.created, "model": ids.model, "choices": [],
           "usage": _stream_usage(usage_)}
    if system_fingerprint is not None:
        out["system_fingerprint"] = system_fingerprint
    return out


def text_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
                logprobs: Mapping[str, Any] | None, prompt_logprobs_: list[Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": None, "prompt_logprobs": prompt_logprobs_,
            "prompt_token_ids": None, "routed_experts": None}


def text_completion(ids: Ids, choices: Sequence[Mapping[str, Any]], usage_: Mapping[str, Any],
                    system_fingerprint: str | None = None) -> dict[str, Any]:
    """A ``text_completion`` object (``/v1/completions``)."""
    return {"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
            "choices": list(choices), "service_tier": None, "system_fingerprint": system_fingerprint,
            "usage": dict(usage_), "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def text_chunk(ids: Ids, index: int, text: str, *, finish_reason: str | None = None,
               stop_reason: int | str | None = None, logprobs: Mapping[str, Any] | None = None,
               usage_: Mapping[str, Any] | None = None, system_fingerprint: str | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (vLLM's carry ``prompt_token_ids`` and ``token_ids``, null unless
    asked for)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": None}
    out: dict[str, Any] = {"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
                           "choices": [choice]}
    if usage_ is not None:
        out["usage"] = _stream_usage(usage_)
    if system_fingerprint is not None:
        out["system_fingerprint"] = system_fingerprint
    return out


def sse(event: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``data: {json}`` (or ``data: [DONE]``) and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def tokenize_result(tokens: Sequence[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    """``POST /tokenize``: vLLM always sends ``token_strs`` (null unless asked for)."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens), "token_strs": token_strs}
