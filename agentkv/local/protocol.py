"""vLLM's OpenAI-compatible wire format as pure functions: request parsing and response, chunk and metric text.

Nothing here touches a model or a socket; :mod:`agentkv.local.routes` carries out what these decide.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from agentkv.local.codec import ChatRequest
from agentkv.local.limits import error_body


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with vLLM's error JSON."""

    def __init__(self, message: str, *, status: int = 400, type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type=type, param=param, code=status)


@dataclass(frozen=True)
class ChatCall:
    """A parsed ``/v1/chat/completions`` body."""

    model: str | None
    chat: ChatRequest
    max_tokens: int | None
    max_tokens_param: str
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool
    cache_salt: str | None


@dataclass(frozen=True)
class TokenizeCall:
    """A parsed ``/tokenize`` body: a chat (``chat`` set) or a plain prompt."""

    model: str | None
    chat: ChatRequest | None = None
    prompt: str = ""
    add_special_tokens: bool = True
    return_token_strs: bool = False


@dataclass
class ChatIds:
    """The identity every response and chunk of one request repeats."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError("The request body must be a JSON object.")
    return body


def _optional_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name} must be a positive integer, got {value!r}.", param=name)
    return value


def _chat_request(body: Mapping[str, Any], *, generation_default: bool = True) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise RequestError("messages must be a list of message objects.", param="messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise RequestError("chat_template_kwargs must be an object.", param="chat_template_kwargs")
    continue_final = bool(body.get("continue_final_message", False))
    add_prompt = bool(body.get("add_generation_prompt", generation_default and not continue_final))
    if continue_final and add_prompt:
        raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return ChatRequest(messages, body.get("tools") or None, body.get("tool_choice"), add_prompt,
                       continue_final, dict(kwargs))


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    return salt


def parse_chat(body: Any) -> ChatCall:
    """A ``/v1/chat/completions`` body, validated as vLLM validates the fields agentkv serves."""
    body = _require_object(body)
    if body.get("max_completion_tokens") is not None:
        max_tokens, param = _optional_int(body, "max_completion_tokens"), "max_completion_tokens"
    else:
        max_tokens, param = _optional_int(body, "max_tokens"), "max_tokens"
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    if options and not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
    temperature = body.get("temperature")
    return ChatCall(body.get("model"), _chat_request(body), max_tokens, param,
                    float(temperature) if temperature is not None else 0.0, body.get("seed"), stream,
                    bool(options.get("include_usage", False)), _cache_salt(body))


def parse_tokenize(body: Any) -> TokenizeCall:
    """A ``/tokenize`` body: the chat form when it has ``messages``, the prompt form otherwise."""
    body = _require_object(body)
    strs = bool(body.get("return_token_strs", False))
    if "messages" in body:
        return TokenizeCall(body.get("model"), _chat_request(body),
                            add_special_tokens=bool(body.get("add_special_tokens", False)), return_token_strs=strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string.", param="prompt")
    return TokenizeCall(body.get("model"), prompt=prompt,
                        add_special_tokens=bool(body.get("add_special_tokens", True)), return_token_strs=strs)


def model_not_found(model: str) -> RequestError:
    """vLLM's 404 for a model id it does not serve."""
    return RequestError(f"The model `{model}` does not exist.", status=404, type="NotFoundError", param="model")


def models_list(model_id: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": None, "max_model_len": max_model_len, "permission": []}
    return {"object": "list", "data": [card]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object, with ``prompt_tokens_details.cached_tokens`` filled in."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split hermes-style ``<tool_call>{json}</tool_call>`` blocks out of ``text``, as vLLM's hermes parser does.

    Returns the remaining content (None when nothing is left) and OpenAI ``tool_calls``; text whose blocks do
    not all parse is returned unchanged with no calls.
    """
    calls = []
    for raw in _TOOL_CALL.findall(text):
        try:
            parsed = json.loads(raw)
            name, arguments = parsed["name"], parsed.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        calls.append({"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = text[: text.find("<tool_call>")].strip()
    return content or None, calls


def completion(ids: ChatIds, text: str, finish_reason: str, usage_: Mapping[str, Any],
               tools_enabled: bool) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    content, tool_calls = parse_tool_calls(text) if tools_enabled else (text, [])
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "tool_calls": tool_calls, "reasoning_content": None}
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": "tool_calls" if tool_calls else finish_reason, "stop_reason": None}
    return {"id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": dict(usage_),
            "prompt_logprobs": None, "kv_transfer_params": None}


def chunk(ids: ChatIds, delta: Mapping[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice."""
    choice: dict[str, Any] = {"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    return {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "choices": [choice]}


def usage_chunk(ids: ChatIds, usage_: Mapping[str, Any]) -> dict[str, Any]:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    return {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "choices": [], "usage": dict(usage_)}


def sse(event: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``data: {json}`` (or ``data: [DONE]``) and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def tokenize_result(tokens: Sequence[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    """``POST /tokenize``: vLLM always sends ``token_strs`` (null unless asked for)."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens), "token_strs": token_strs}
