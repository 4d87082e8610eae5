"""A fake of OpenAI's prompt caching behind ``POST /v1/chat/completions`` (and ``POST /v1/responses``, prewarm included).

What it implements:

* Caching is automatic; a prompt under ``min_cache_tokens`` (1024) neither reads nor writes. A request is routed to
  one of ``machines`` (4) machines, each with its own cache, by a hash of the model, ``prompt_cache_key`` and the
  first 256 tokens: another key (or another start) can land elsewhere and miss. Past ``overflow_per_minute`` (15)
  requests a minute on one key+prefix, requests spill to the next machine. ``usage.prompt_tokens_details`` has
  ``cached_tokens`` (read) and ``cache_write_tokens`` (newly written), disjoint parts of ``prompt_tokens``.
* Before GPT-5.6 (gpt-5.1 ...): a hit is the longest common prefix with a live entry on the machine, rounded down
  to ``1024 + 128k`` tokens; the request writes its prompt rounded the same way (free on these models).
  ``prompt_cache_retention``: ``"in_memory"`` (10 idle minutes, refreshed by a hit, an hour at most; the fake's
  default, see ``default_retention``) or ``"24h"`` (a day from the write); gpt-5.5 and later take only ``"24h"``.
* GPT-5.6 and later: breakpoints. A request writes at its implicit breakpoint (the end of its newest
  system/developer/user/tool message) and at its latest three explicit ones (content parts carrying
  ``prompt_cache_breakpoint: {"mode": "explicit", "ttl"?}``), or four with ``prompt_cache_options.mode:
  "explicit"`` (no implicit one then). A hit is the longest live entry that is an exact prefix of the prompt: no
  128-token rounding and no shorter unmarked prefix, so an unchanged system prompt before a changed last message
  misses unless a breakpoint ends it. Entries live their ttl (``30m``; ``12h`` on a breakpoint or a Responses
  request) from the last write or hit, a day at most.
* Token counts: the prompt renders tools first (OpenAI renders them into the system prefix), then a
  structured-output schema, then each message as ``<|start|> role ... <|end|>``, then ``<|start|> assistant``;
  text goes through :func:`fake_tokens`, an image/audio/file part counts 85 tokens. ``count(body)`` is the
  ``prompt_tokens`` the fake answers.
* Validation: the bearer key (401); unknown top-level arguments (400 ``Unrecognized request argument supplied:
  NAME``, so ``cache_salt`` is refused); enum values; ``max_tokens`` on reasoning models; prompts over a model's
  input limit (400 ``context_length_exceeded``); unknown models (404). ``GET /v1/models`` lists ids, no windows.
* Prewarm: the SDK has none for Chat Completions. Responses has ``prompt_cache_options: {"prewarm": true}``
  (``client.responses.create(..., prompt_cache_options={"prewarm": True})``): it writes and generates nothing.
  ``/v1/responses`` serves it and plain generations, sharing the Chat Completions caches (same render).

Sources: OpenAI's prompt caching guide (developers.openai.com/api/docs/guides/prompt-caching) and cookbook "Prompt
Caching 201"; the openai SDK 3.57 types (``chat/completion_create_params.py``, ``completion_usage.py``,
``responses/response_create_params.py``, ``responses/response_usage.py``); what litellm 1.110 sends and parses.

What this fake leaves out: OpenAI's tokenizer and real rendering (hidden system content, image sizing); the real
routing and overflow internals (hash, machine count and spill target are a model); eviction under memory pressure
and entries outliving their ttl; the 80-breakpoint lookback; streaming (``stream: true`` is a 400: the shared server
writes JSON only); the rest of the Responses API (conversations, ``previous_response_id``, built-in tools,
background, WebSocket ``generate: false``) and whether its cache is really shared with Chat Completions; audio and
image output; real generation (a fixed sentence); organisation/project scoping; rate limits; the
``comparison_response_id`` diagnostics. Guessed: the 400 for ``prompt_cache_options`` before GPT-5.6, ignoring a
breakpoint there, and reporting ``cache_write_tokens`` on those older models.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from agentkv.testing.providers.server import Call, FakeServer, JsonReply, fake_tokens

__all__ = ["CHAT_PARAMS", "CONTEXT_WINDOWS", "CacheEntry", "FakeOpenAI", "RESPONSES_PARAMS", "Served"]

CHAT_PARAMS = frozenset({  # openai SDK 3.57 CompletionCreateParams
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options"})
RESPONSES_PARAMS = frozenset({  # openai SDK 3.57 ResponseCreateParams
    "access_programs", "background", "background_options", "context_management", "conversation", "image", "include",
    "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user"})
# Input-token limits, from litellm 1.110's cost map (max_input_tokens).
CONTEXT_WINDOWS: Mapping[str, int] = {
    "gpt-6-sol": 922_000, "gpt-5.6": 922_000, "gpt-5.6-sol": 922_000, "gpt-5.6-terra": 922_000,
    "gpt-5.6-luna": 922_000, "gpt-5.5": 1_050_000, "gpt-5.4": 1_050_000, "gpt-5.2": 272_000, "gpt-5.1": 272_000,
    "gpt-5": 272_000, "gpt-5-mini": 272_000, "gpt-4.1": 1_047_576, "gpt-4o": 128_000}

_OPEN, _CLOSE = "<|start|>", "<|end|>"
_IMPLICIT_ROLES = frozenset({"system", "developer", "user", "tool", "function"})
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_MEDIA_TOKENS = 85
_TTL_S = {"30m": 1800.0, "12h": 43200.0}
_DAY_S, _HOUR_S = 86400.0, 3600.0
_REPLY = fake_tokens("This is a fake reply .")
_VERSION = re.compile(r"^(?:ft:)?gpt-(\d+)(?:\.(\d+))?")


class _Rejected(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.reply = JsonReply(status, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                              "code": code}})


@dataclass
class CacheEntry:
    """A cached prefix on one machine."""

    model: str
    machine: int
    tokens: tuple[str, ...]
    written_at: float
    expires_at: float
    idle_s: float  # how far a hit pushes expires_at
    hard_at: float  # never alive past this


@dataclass(frozen=True)
class Served:
    """One answered request: where it ran and what it read and wrote."""

    path: str
    model: str
    machine: int
    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    ttl_12h_tokens: int = 0


@dataclass
class _Render:
    tokens: list[str] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # after each message that may carry the implicit breakpoint
    marks: list[tuple[int, str | None]] = field(default_factory=list)  # explicit breakpoints: (end, ttl)

    def message(self, role: str, parts: list[Any], breakpoints: bool = True) -> None:
        self.tokens += [_OPEN, role]
        for part in parts:
            self.tokens += _part_tokens(part)
            mark = part.get("prompt_cache_breakpoint") if isinstance(part, dict) else None
            if mark is not None and breakpoints and role != "assistant":
                self.marks.append((len(self.tokens), _mark_ttl(mark)))
        self.tokens.append(_CLOSE)
        if role in _IMPLICIT_ROLES:
            self.ends.append(len(self.tokens))


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _part_tokens(part: Any) -> list[str]:
    if part is None:
        return []
    if not isinstance(part, dict):
        return fake_tokens(part if isinstance(part, str) else _canon(part))
    if part.get("type") in _TEXT_PARTS or part.get("type") == "refusal":
        return fake_tokens(str(part.get("text", part.get("refusal", ""))))
    digest = hashlib.sha256(_canon({k: v for k, v in part.items() if k != "prompt_cache_breakpoint"}).encode())
    return [f"<media:{digest.hexdigest()[:12]}:{i}>" for i in range(_MEDIA_TOKENS)]


def _mark_ttl(mark: Any) -> str | None:
    if not isinstance(mark, dict) or mark.get("mode") != "explicit" or mark.get("ttl", "30m") not in _TTL_S:
        raise _Rejected(400, f"Invalid value for 'prompt_cache_breakpoint': {_canon(mark)}.",
                        "prompt_cache_breakpoint", "invalid_value")
    return mark.get("ttl")


def _render_prefix(r: _Render, tools: list[Any], schema: Any) -> None:
    if tools:
        r.tokens.append("<|tools|>")
        for tool in tools:
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            shown = {k: fn.get(k) for k in ("name", "description", "parameters")} if tool.get("type") == "function" \
                else tool
            r.tokens += fake_tokens(_canon(shown))
        r.tokens.append(_CLOSE)
    if isinstance(schema, dict) and schema.get("type") == "json_schema":
        inner = schema.get("json_schema", schema)
        r.tokens += ["<|format|>", *fake_tokens(_canon({k: inner.get(k) for k in ("name", "schema", "strict")})),
                     _CLOSE]


def _listed(content: Any) -> list[Any]:
    return content if isinstance(content, list) else [content]


def _render_chat(body: Mapping[str, Any], breakpoints: bool) -> _Render:
    r = _Render()
    functions = [{"type": "function", "function": f} for f in body.get("functions") or []]
    _render_prefix(r, list(body.get("tools") or []) + functions, body.get("response_format"))
    for m in body.get("messages") or []:
        calls = [_canon(c.get("function", c)) for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        r.message(str(m.get("role")), [m.get("name"), *_listed(m.get("content")), *calls], breakpoints)
    r.tokens += [_OPEN, "assistant"]
    return r


def _render_responses(body: Mapping[str, Any], breakpoints: bool) -> _Render:
    r = _Render()
    _render_prefix(r, list(body.get("tools") or []), (body.get("text") or {}).get("format"))
    if body.get("instructions"):
        r.message("developer", [body["instructions"]])
    items = body.get("input")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items or []:
        if "role" in item:
            r.message(str(item["role"]), _listed(item.get("content")), breakpoints)
        elif item.get("type") == "function_call_output":
            r.message("tool", _listed(item.get("output")), breakpoints)
        else:
            r.message(str(item.get("type")), [_canon(item)], breakpoints)
    r.tokens += [_OPEN, "assistant"]
    return r


def _check_items(body: Mapping[str, Any], responses: bool) -> None:
    name = "input" if responses else "messages"
    items = body.get(name)
    if items is None and not responses:
        raise _Rejected(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    listed = [] if items is None or (responses and isinstance(items, str)) else items
    if not isinstance(listed, list) or not all(isinstance(item, dict) for item in listed):
        raise _Rejected(400, f"Invalid type for '{name}': expected an array of objects.", name, "invalid_type")


def _version(model: str) -> tuple[int, int]:
    found = _VERSION.match(model)
    return (int(found.group(1)), int(found.group(2) or 0)) if found else (0, 0)


def _reasoning(model: str) -> bool:
    return (_version(model) >= (5, 0) and "-chat" not in model) or re.match(r"^o\d", model) is not None


class FakeOpenAI:
    """OpenAI's Chat Completions (and Responses) prompt caching on 127.0.0.1; use it in a ``with`` block."""

    def __init__(self, *, api_key: str = "sk-test", clock: Callable[[], float] = time.monotonic, machines: int = 4,
                 min_cache_tokens: int = 1024, increment: int = 128, idle_s: float = 600.0,
                 overflow_per_minute: int | None = 15, context_windows: Mapping[str, int] | None = None,
                 default_retention: str = "in_memory") -> None:
        self.api_key, self.clock, self.machines = api_key, clock, machines
        self.min_cache_tokens, self.increment, self.idle_s = min_cache_tokens, increment, idle_s
        self.overflow_per_minute, self.default_retention = overflow_per_minute, default_retention
        self.context_windows = dict(CONTEXT_WINDOWS if context_windows is None else context_windows)
        self.requests: list[dict[str, Any]] = []  # every chat-completions body received
        self.served: list[Served] = []
        self._caches: list[dict[tuple[str, tuple[str, ...]], CacheEntry]] = [{} for _ in range(machines)]
        self._recent: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server = FakeServer(self._handle, clock=clock)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``; litellm's ``api_base`` is ``url + "/v1"``."""
        return self._server.url

    def __enter__(self) -> FakeOpenAI:
        self._server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.__exit__(*exc)

    def count(self, body: Mapping[str, Any]) -> int:
        """The ``prompt_tokens`` the fake answers for a chat (or, with ``input``, a Responses) body."""
        render = _render_responses if "input" in body else _render_chat
        return len(render(body, False).tokens)

    def machine_for(self, body: Mapping[str, Any]) -> int:
        """The machine a body is routed to, overflow aside."""
        render = _render_responses if "input" in body else _render_chat
        return self._home(str(body.get("model")), body.get("prompt_cache_key"), render(body, False).tokens)[1]

    def entries(self, machine: int | None = None) -> list[CacheEntry]:
        """The live cache entries, on one machine or all."""
        with self._lock:
            self._purge(self.clock())
            chosen = self._caches if machine is None else [self._caches[machine]]
            return [entry for cache in chosen for entry in cache.values()]

    # -- HTTP --------------------------------------------------------------------------------------------------

    def _handle(self, call: Call) -> JsonReply:
        try:
            self._check_key(call.headers.get("authorization"))
            if call.method == "GET" and call.path.rstrip("/") == "/v1/models":
                return JsonReply(200, {"object": "list", "data": [self._model(m) for m in self.context_windows]})
            if call.method == "GET" and call.path.startswith("/v1/models/"):
                return JsonReply(200, self._model(self._known(call.path.rsplit("/", 1)[1])))
            if call.method == "POST" and call.path == "/v1/chat/completions":
                if isinstance(call.body, dict):
                    self.requests.append(call.body)
                return JsonReply(200, self._chat(self._checked(call.body, CHAT_PARAMS)))
            if call.method == "POST" and call.path == "/v1/responses":
                return JsonReply(200, self._responses(self._checked(call.body, RESPONSES_PARAMS)))
            raise _Rejected(404, f"Invalid URL ({call.method} {call.path})")
        except _Rejected as rejected:
            return rejected.reply

    def _check_key(self, header: str | None) -> None:
        if not header or not header.startswith("Bearer "):
            raise _Rejected(401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        if header != f"Bearer {self.api_key}":
            raise _Rejected(401, f"Incorrect API key provided: {header[7:11]}****.", None, "invalid_api_key")

    def _model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 1_700_000_000, "owned_by": "system"}

    def _known(self, model: Any) -> str:
        if model not in self.context_windows:
            raise _Rejected(404, f"The model `{model}` does not exist or you do not have access to it.", None,
                            "model_not_found")
        return str(model)

    def _checked(self, body: Any, known: frozenset[str]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _Rejected(400, "We could not parse the JSON body of your request.")
        for name in body:
            if name not in known and "input" in known:
                raise _Rejected(400, f"Unknown parameter: '{name}'.", name, "unknown_parameter")
            if name not in known:
                raise _Rejected(400, f"Unrecognized request argument supplied: {name}")
        model = self._known(body.get("model"))
        _check_items(body, "input" in known)
        if body.get("stream"):
            raise _Rejected(400, "This fake does not stream: send stream=false.", "stream", "unsupported_value")
        if "max_tokens" in body and _reasoning(model):
            raise _Rejected(400, "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                            "'max_completion_tokens' instead.", "max_tokens", "unsupported_parameter")
        self._check_retention(model, body.get("prompt_cache_retention"))
        self._check_options(model, body.get("prompt_cache_options"), "input" in known)
        return body

    def _check_retention(self, model: str, retention: Any) -> None:
        if retention is not None and retention not in ("in_memory", "24h"):
            raise _Rejected(400, f"Invalid value: '{retention}'. Supported values are: 'in_memory' and '24h'.",
                            "prompt_cache_retention", "invalid_value")
        if retention == "in_memory" and _version(model) >= (5, 5):
            raise _Rejected(400, "Unsupported value: 'prompt_cache_retention' does not support 'in_memory' with this "
                            "model. Supported values are: '24h'.", "prompt_cache_retention", "unsupported_value")

    def _check_options(self, model: str, options: Any, responses: bool) -> None:
        if options is None:
            return
        if _version(model) < (5, 6):
            raise _Rejected(400, "Unsupported parameter: 'prompt_cache_options' is not supported with this model.",
                            "prompt_cache_options", "unsupported_parameter")
        fields = {"mode", "ttl", "prewarm", "comparison_response_id"} if responses else {"mode", "ttl"}
        for name in options:
            if name not in fields:
                raise _Rejected(400, f"Unknown parameter: 'prompt_cache_options.{name}'.",
                                f"prompt_cache_options.{name}", "unknown_parameter")
        ttls = ("30m", "12h") if responses else ("30m",)
        if options.get("mode", "implicit") not in ("implicit", "explicit") or options.get("ttl", "30m") not in ttls:
            raise _Rejected(400, f"Invalid value for 'prompt_cache_options': {_canon(options)}.",
                            "prompt_cache_options", "invalid_value")

    # -- the two endpoints -------------------------------------------------------------------------------------

    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        render = _render_chat(body, _version(body["model"]) >= (5, 6))
        self._fits(body["model"], len(render.tokens), "This model's maximum context length is {n} tokens. However, "
                   "your messages resulted in {m} tokens. Please reduce the length of the messages.")
        served = self._serve("/v1/chat/completions", body, render)
        words, finish = _answer(body.get("max_completion_tokens") or body.get("max_tokens"))
        message: dict[str, Any] = {"role": "assistant", "content": " ".join(words), "refusal": None, "annotations": []}
        choices: list[dict[str, Any]] = [{"index": i, "message": message, "logprobs": None, "finish_reason": finish}
                                         for i in range(int(body.get("n") or 1))]
        out = len(words) * len(choices)
        usage = {"prompt_tokens": served.prompt_tokens, "completion_tokens": out,
                 "total_tokens": served.prompt_tokens + out,
                 "prompt_tokens_details": {"cached_tokens": served.cached_tokens, "audio_tokens": 0,
                                           "cache_write_tokens": served.cache_write_tokens},
                 "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                               "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}
        return {"id": f"chatcmpl-fake{next(self._ids)}", "object": "chat.completion", "created": int(time.time()),
                "model": body["model"], "choices": choices, "usage": usage, "service_tier": "default",
                "system_fingerprint": None}

    def _responses(self, body: dict[str, Any]) -> dict[str, Any]:
        render = _render_responses(body, _version(body["model"]) >= (5, 6))
        self._fits(body["model"], len(render.tokens), "Your input exceeds the context window of this model. "
                   "Please adjust your input and try again.")
        served = self._serve("/v1/responses", body, render)
        prewarm = bool((body.get("prompt_cache_options") or {}).get("prewarm"))
        words, finish = ([], "stop") if prewarm else _answer(body.get("max_output_tokens"))
        text = {"type": "output_text", "text": " ".join(words), "annotations": []}
        output = [] if prewarm else [{"type": "message", "id": f"msg_fake{next(self._ids)}", "status": "completed",
                                      "role": "assistant", "content": [text]}]
        details = {"cached_tokens": served.cached_tokens, "cache_write_tokens": served.cache_write_tokens,
                   "cache_write_tokens_details": {"ttl_30m_tokens": served.cache_write_tokens - served.ttl_12h_tokens,
                                                  "ttl_12h_tokens": served.ttl_12h_tokens}}
        usage = {"input_tokens": served.prompt_tokens, "input_tokens_details": details, "output_tokens": len(words),
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": served.prompt_tokens + len(words)}
        return {"id": f"resp_fake{next(self._ids)}", "object": "response", "created_at": int(time.time()),
                "status": "completed" if finish == "stop" else "incomplete", "model": body["model"],
                "incomplete_details": None if finish == "stop" else {"reason": "max_output_tokens"},
                "output": output, "usage": usage, "error": None, "instructions": body.get("instructions"),
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": body.get("tools") or [],
                "prompt_cache_key": body.get("prompt_cache_key")}

    def _fits(self, model: str, tokens: int, message: str) -> None:
        limit = self.context_windows[model]
        if tokens > limit:
            raise _Rejected(400, message.format(n=limit, m=tokens), "messages", "context_length_exceeded")

    # -- routing and caches ------------------------------------------------------------------------------------

    def _home(self, model: str, key: Any, tokens: list[str]) -> tuple[str, int]:
        route = hashlib.sha256("\x00".join([model, str(key or ""), *tokens[:256]]).encode()).hexdigest()
        return route, int(route, 16) % self.machines

    def _route(self, model: str, key: Any, tokens: list[str], now: float) -> int:
        route, home = self._home(model, key, tokens)
        if self.overflow_per_minute is None:
            return home
        recent = [t for t in self._recent.get(route, []) if now - t < 60.0] + [now]
        self._recent[route] = recent
        return home if len(recent) <= self.overflow_per_minute else (home + 1) % self.machines

    def _purge(self, now: float) -> None:
        for cache in self._caches:
            for name in [name for name, entry in cache.items() if entry.expires_at <= now]:
                del cache[name]

    def _block(self, n: int) -> int:
        return 0 if n < self.min_cache_tokens else n - (n - self.min_cache_tokens) % self.increment

    def _serve(self, path: str, body: Mapping[str, Any], render: _Render) -> Served:
        model, tokens = body["model"], tuple(render.tokens)
        with self._lock:
            now = self.clock()
            self._purge(now)
            machine = self._route(model, body.get("prompt_cache_key"), render.tokens, now)
            cache = self._caches[machine]
            marked = _version(model) >= (5, 6)
            read = self._read(cache, model, tokens, now, exact=marked)
            writes = self._breakpoints(body, render) if marked else self._legacy_writes(body, len(tokens))
            for end, idle_s, hard_s in writes:
                self._store(cache, machine, model, tokens[:end], now, idle_s, hard_s)
            written = max([end - read for end, _, _ in writes] + [0])
            long_ = max([end - read for end, idle_s, _ in writes if idle_s > _TTL_S["30m"]] + [0])
            served = Served(path, model, machine, len(tokens), read, written, long_ if marked else 0)
            self.served.append(served)
        return served

    def _read(self, cache: dict[Any, CacheEntry], model: str, tokens: tuple[str, ...], now: float, exact: bool) -> int:
        best, hit = 0, None
        for entry in cache.values():
            whole = entry.model == model and tokens[:len(entry.tokens)] == entry.tokens
            n = len(entry.tokens) if whole else 0 if exact or entry.model != model else _common(entry.tokens, tokens)
            best, hit = (n, entry) if n > best else (best, hit)
        read = best if exact else self._block(best)
        if read and hit is not None:
            hit.expires_at = min(now + hit.idle_s, hit.hard_at)
        return read

    def _legacy_writes(self, body: Mapping[str, Any], length: int) -> list[tuple[int, float, float]]:
        end = self._block(length)
        retention = body.get("prompt_cache_retention") or (
            "24h" if _version(str(body["model"])) >= (5, 5) else self.default_retention)
        lifetime = (_DAY_S, _DAY_S) if retention == "24h" else (self.idle_s, _HOUR_S)
        return [(end, *lifetime)] if end else []

    def _breakpoints(self, body: Mapping[str, Any], render: _Render) -> list[tuple[int, float, float]]:
        options = body.get("prompt_cache_options") or {}
        ttl = options.get("ttl", "30m")
        explicit = options.get("mode") == "explicit"
        chosen = [(end, mark or ttl) for end, mark in render.marks][-4 if explicit else -3:]
        if not explicit and render.ends:
            chosen.append((render.ends[-1], ttl))
        return [(end, _TTL_S[mark], _DAY_S) for end, mark in chosen if end >= self.min_cache_tokens]

    def _store(self, cache: dict[Any, CacheEntry], machine: int, model: str, tokens: tuple[str, ...], now: float,
               idle_s: float, hard_s: float) -> None:
        entry = cache.get((model, tokens))
        if entry is None:
            cache[(model, tokens)] = CacheEntry(model, machine, tokens, now, now + idle_s, idle_s, now + hard_s)
        else:
            entry.idle_s = max(entry.idle_s, idle_s)
            entry.expires_at = min(max(entry.expires_at, now + idle_s), entry.hard_at)


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _answer(budget: Any) -> tuple[list[str], str]:
    if isinstance(budget, int) and budget < len(_REPLY):
        return _REPLY[:budget], "length"
    return list(_REPLY), "stop"
