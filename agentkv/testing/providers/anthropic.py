"""A fake of Anthropic's Messages API with its prompt caching, token counting and Models API.

    with FakeAnthropic(clock=FakeClock()) as fake:
        litellm.completion(model="anthropic/claude-sonnet-4-5", api_base=fake.url, api_key="sk-ant-test", ...)

``fake.url`` is ``http://127.0.0.1:PORT`` with no path: litellm's Anthropic chat path appends ``/v1/messages``
itself (``ensure_api_route(api_base, "v1/messages")`` in ``litellm.main``; a base already ending in ``/v1/messages``
is kept) and its count-tokens path appends ``/v1/messages/count_tokens`` after stripping either suffix.

What it implements, from Anthropic's prompt caching guide, the Messages, Token Counting and Models API references,
checked against what litellm 1.110's ``llms/anthropic`` code sends and parses:

* ``POST /v1/messages``: ``x-api-key`` (or ``authorization: Bearer``) and ``anthropic-version`` required; ``model``,
  ``max_tokens`` (an integer >= 1) and ``messages`` required; any top-level field outside :data:`MESSAGES_FIELDS`
  answers 400 ``invalid_request_error`` ``"<field>: Extra inputs are not permitted"``.
* Tokens: the prompt renders in cache order (tools, then system, then messages) as a list of blocks: each tool
  definition, each system block, each message content block (a string ``content``/``system`` is one text block).
  A text block is its ``text``; any other block, and a tool, is its canonical JSON (sorted keys, no spaces,
  ``cache_control`` removed, a tool's ``"type": "custom"`` removed); its tokens are :func:`fake_tokens` of that
  rendering. Each message adds :data:`MESSAGE_OVERHEAD` tokens to its first block. ``count_tokens`` uses the same.
* Prompt caching: ``cache_control: {"type": "ephemeral", "ttl"?: "5m"|"1h"}`` on a tool, a system block or a
  content block (or top-level, "automatic caching": on the last block) is a breakpoint; more than 4 answer 400.
  An entry is keyed by (API key, model, hash of the rendered prefix up to and including the block). A read looks
  at each breakpoint and the :data:`LOOKBACK_BLOCKS` block boundaries before it; the longest live entry found is
  ``cache_read_input_tokens`` and its TTL is refreshed. Every breakpoint after it whose prefix reaches the model's
  minimum is written; ``cache_creation_input_tokens`` runs from the read's end to the furthest one written, each
  span billed at the TTL of the breakpoint that ends it (``usage.cache_creation``). ``input_tokens`` is the rest.
* A prompt over the model's window answers 400 ``"prompt is too long: N tokens > W maximum"``.
* ``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``, N = input + cache write + cache read tokens
  of the same body on ``/v1/messages``. ``GET /v1/models`` and ``GET /v1/models/{id}`` (an undated alias resolves).

What this fake leaves out of the real API:

* streaming (``stream: true`` answers 400 here), the exact tokenizer, images/PDFs/documents priced by size
  (they count as their JSON here), tool-use and server tools (the answer is always one text block);
* the output-side limits: ``max_tokens`` above the model's output maximum, and newer models' 400 when input plus
  ``max_tokens`` exceed the window (only the input is checked here);
* cache invalidation by anything outside the rendered blocks: changing ``tool_choice``, ``thinking`` parameters,
  images' presence, or the model's system-prompt additions for tools; thinking blocks' cache rules (they cannot
  carry ``cache_control`` and are stripped from earlier turns); ``cache_control`` on an empty text block (a 400);
  the rule that a ``1h`` breakpoint must precede ``5m`` ones; whether a read also refreshes entries at earlier
  breakpoints (here only the entry read is); the exact lookback depth (the guide says "about 20 blocks");
* caching timing: a real entry becomes readable only once the first response starts (concurrent identical
  requests both write); eviction before the TTL; workspace/organisation isolation is modelled as per-API-key;
* per-request validation of roles' alternation, empty content, tool_use/tool_result pairing, the ``model`` alias
  resolution in the answer (the request's ``model`` is echoed), rate limits (429), overload (529), beta headers,
  ``service_tier``/``container``/``mcp_servers`` semantics (accepted, ignored), and ``count_tokens``' own limits.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

from agentkv.testing.providers.server import Call, FakeServer, JsonReply, fake_tokens

__all__ = ["COUNT_FIELDS", "DEFAULT_MIN_CACHEABLE", "DEFAULT_MODELS", "DEFAULT_WINDOWS", "LOOKBACK_BLOCKS",
           "MAX_BREAKPOINTS", "MESSAGES_FIELDS", "MESSAGE_OVERHEAD", "CacheEntry", "FakeAnthropic",
           "FakeAnthropicError"]

#: Top-level fields /v1/messages accepts: the Messages API reference, cross-checked with litellm's
#: ``AnthropicMessagesRequestOptionalParams`` (less its litellm-internal keys).
MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "tools", "tool_choice", "metadata", "stop_sequences", "stream",
    "temperature", "top_p", "top_k", "thinking", "service_tier", "container", "mcp_servers", "context_management",
    "cache_control", "output_config", "output_format", "inference_geo", "speed"})
#: Top-level fields /v1/messages/count_tokens accepts.
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers",
                          "context_management", "cache_control", "output_config", "output_format"})
MAX_BREAKPOINTS = 4
LOOKBACK_BLOCKS = 20  # block boundaries checked before each breakpoint ("about 20" in Anthropic's guide)
MESSAGE_OVERHEAD = 3  # tokens a message adds (its role marker) to its first block
TTL_SECONDS: Mapping[str, float] = {"5m": 300.0, "1h": 3600.0}
FALLBACK_MIN_CACHEABLE = 1024
FALLBACK_WINDOW = 200_000
#: Minimum cacheable prefix by model-id prefix (longest match wins): Anthropic's prompt caching guide, equal to
#: litellm's cost-map ``prompt_cache_min_tokens`` for every Anthropic entry it has (tests check that).
DEFAULT_MIN_CACHEABLE: Mapping[str, int] = {
    "claude-3-haiku": 2048, "claude-3-5-haiku": 2048, "claude-3-7-sonnet": 1024, "claude-sonnet-4": 1024,
    "claude-opus-4": 1024, "claude-sonnet-4-5": 1024, "claude-sonnet-4-6": 1024, "claude-haiku-4-5": 4096,
    "claude-opus-4-5": 4096, "claude-opus-4-6": 4096, "claude-opus-4-7": 2048, "claude-opus-4-8": 1024,
    "claude-sonnet-5": 1024, "claude-sonnet-5-5": 512, "claude-opus-5": 512, "claude-haiku-5-5": 512,
    "claude-fable-5": 512, "claude-mythos-5": 512, "claude-mythos-preview": 512, "claude-sonnet-latest": 512,
    "claude-opus-latest": 512, "claude-haiku-latest": 512, "claude-fable-latest": 512}
#: Context windows by model-id prefix (200k unless listed; litellm's cost-map ``max_input_tokens`` agrees).
DEFAULT_WINDOWS: Mapping[str, int] = {
    "claude-sonnet-4-6": 1_000_000, "claude-opus-4-6": 1_000_000, "claude-opus-4-7": 1_000_000,
    "claude-opus-4-8": 1_000_000, "claude-sonnet-5": 1_000_000, "claude-opus-5": 1_000_000,
    "claude-haiku-5": 1_000_000, "claude-fable": 1_000_000, "claude-mythos": 1_000_000,
    "claude-sonnet-latest": 1_000_000, "claude-opus-latest": 1_000_000, "claude-haiku-latest": 1_000_000}
#: What GET /v1/models lists, newest first: (id, display_name, created_at).
DEFAULT_MODELS: tuple[tuple[str, str, str], ...] = (
    ("claude-opus-4-5-20251101", "Claude Opus 4.5", "2025-11-24T00:00:00Z"),
    ("claude-haiku-4-5-20251001", "Claude Haiku 4.5", "2025-10-15T00:00:00Z"),
    ("claude-sonnet-4-5-20250929", "Claude Sonnet 4.5", "2025-09-29T00:00:00Z"),
    ("claude-opus-4-1-20250805", "Claude Opus 4.1", "2025-08-05T00:00:00Z"),
    ("claude-sonnet-4-20250514", "Claude Sonnet 4", "2025-05-22T00:00:00Z"),
    ("claude-3-5-haiku-20241022", "Claude Haiku 3.5", "2024-10-22T00:00:00Z"))
_REPLY = "This is a fake reply from the Anthropic Messages API fake ."


class FakeAnthropicError(Exception):
    """An error answer: HTTP status, Anthropic error type and message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def _invalid(message: str) -> FakeAnthropicError:
    return FakeAnthropicError(400, "invalid_request_error", message)


@dataclass(frozen=True)
class CacheEntry:
    """One live cache entry: its scope (the API key), model, prefix hash and length, TTL and expiry time."""

    scope: str
    model: str
    digest: str
    tokens: int
    ttl: str
    expires_at: float


@dataclass(frozen=True)
class _Block:
    tokens: int
    digest: str  # hash of the rendered prefix up to and including this block
    ttl: str | None  # the breakpoint's TTL when the block carries cache_control


@dataclass(frozen=True)
class _Usage:
    read: int
    write_5m: int
    write_1h: int
    uncached: int


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _render(block: Mapping[str, Any], *, tool: bool = False) -> str:
    if not tool and block.get("type") == "text" and isinstance(block.get("text"), str):
        return str(block["text"])
    fields = {k: v for k, v in block.items() if k != "cache_control" and not (tool and k == "type" and v == "custom")}
    return _canonical(fields)


def _as_blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(f"{where}: Input should be a valid string or list")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _invalid(f"{where}.{j}: Input should be a content block with a type")
    return content


def _mark(block: Mapping[str, Any], where: str) -> str | None:
    control, path = block.get("cache_control"), f"{where}.cache_control" if where else "cache_control"
    if control is None:
        return None
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise _invalid(f"{path}.type: Input should be 'ephemeral'")
    ttl = control.get("ttl", "5m")
    if ttl not in TTL_SECONDS:
        raise _invalid(f"{path}.ttl: Input should be '5m' or '1h'")
    return str(ttl)


def _pieces(body: Mapping[str, Any]) -> Iterator[tuple[str, str, int, str | None]]:
    """(hash material, rendering, overhead, breakpoint TTL) for every block, in cache order."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _invalid("tools: Input should be a valid list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid(f"tools.{i}: Input should be a valid dictionary")
        yield "tool", _render(tool, tool=True), 0, _mark(tool, f"tools.{i}")
    system = body.get("system")
    for j, block in enumerate(_as_blocks(system, "system") if system else []):
        yield "system", _render(block), 0, _mark(block, f"system.{j}")
    for i, message in enumerate(body.get("messages") or []):
        where = f"messages.{i}"
        for j, block in enumerate(_as_blocks(message.get("content"), f"{where}.content")):
            overhead = MESSAGE_OVERHEAD if j == 0 else 0
            yield message.get("role", ""), _render(block), overhead, _mark(block, f"{where}.content.{j}")


def _blocks(body: Mapping[str, Any]) -> list[_Block]:
    """The request's blocks with their tokens, chained prefix hashes and breakpoints (at most 4)."""
    blocks, digest = [], ""
    for kind, rendering, overhead, ttl in _pieces(body):
        digest = hashlib.sha256(f"{digest}\x00{kind}\x00{rendering}".encode()).hexdigest()
        blocks.append(_Block(len(fake_tokens(rendering)) + overhead, digest, ttl))
    automatic = _mark(body, "")  # top-level cache_control: automatic caching puts the breakpoint on the last block
    if automatic is not None and blocks and blocks[-1].ttl is None:
        blocks[-1] = replace(blocks[-1], ttl=automatic)
    found = sum(1 for b in blocks if b.ttl)
    if found > MAX_BREAKPOINTS:
        raise _invalid(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {found}.")
    return blocks


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise _invalid("messages: Input should be a valid list")
    if not messages:
        raise _invalid("messages: at least one message is required")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "content" not in message:
            raise _invalid(f"messages.{i}.content: Field required")
        if message.get("role") not in ("user", "assistant"):
            raise _invalid(f"messages.{i}.role: Input should be 'user' or 'assistant'")


def _check_body(body: Any, allowed: frozenset[str], required: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise _invalid("body: Input should be a valid dictionary")
    for field in body:
        if field not in allowed:
            raise _invalid(f"{field}: Extra inputs are not permitted")
    for field in required:
        if field not in body:
            raise _invalid(f"{field}: Field required")
    if not isinstance(body["model"], str) or not body["model"]:
        raise _invalid("model: Input should be a valid string")
    _check_messages(body["messages"])
    return body


def _check_max_tokens(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid("max_tokens: Input should be a valid integer")
    if value < 1:
        raise _invalid("max_tokens: Input should be greater than or equal to 1")
    return value


def _by_prefix(table: Mapping[str, int], model: str, default: int) -> int:
    keys = [k for k in table if model == k or model.startswith(k + "-")]
    return table[max(keys, key=len)] if keys else default


def _reply_text(max_tokens: int) -> tuple[str, int, str]:
    tokens = fake_tokens(_REPLY)
    if len(tokens) <= max_tokens:
        return _REPLY, len(tokens), "end_turn"
    return " ".join(tokens[:max_tokens]), max_tokens, "max_tokens"


class FakeAnthropic:
    """Anthropic's Messages API on 127.0.0.1 (see the module docstring); use it in a ``with`` block."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, min_cacheable: Mapping[str, int] | None = None,
                 windows: Mapping[str, int] | None = None,
                 models: tuple[tuple[str, str, str], ...] = DEFAULT_MODELS) -> None:
        """``min_cacheable`` and ``windows`` override the defaults per model id (or id prefix)."""
        self.clock = clock
        self.min_cacheable_table = {**DEFAULT_MIN_CACHEABLE, **(min_cacheable or {})}
        self.windows = {**DEFAULT_WINDOWS, **(windows or {})}
        self.models = models
        self.requests: list[Any] = []  # every /v1/messages body received, valid or not
        self._cache: dict[tuple[str, str, str], CacheEntry] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server = FakeServer(self._handle, clock=clock)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: pass it as litellm's ``api_base`` (litellm appends ``/v1/messages``)."""
        return self._server.url

    @property
    def calls(self) -> list[Call]:
        """Every HTTP request received, on any path."""
        return self._server.calls

    def __enter__(self) -> "FakeAnthropic":
        self._server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.__exit__(*exc)

    def min_cacheable(self, model: str) -> int:
        """The shortest prefix (fake tokens) ``model`` caches."""
        return _by_prefix(self.min_cacheable_table, model, FALLBACK_MIN_CACHEABLE)

    def window(self, model: str) -> int:
        """``model``'s context window in fake tokens."""
        return _by_prefix(self.windows, model, FALLBACK_WINDOW)

    def count(self, body: Mapping[str, Any]) -> int:
        """The fake's own token count of a Messages body: what /v1/messages bills as input, cached or not."""
        return sum(block.tokens for block in _blocks(body))

    def entries(self) -> list[CacheEntry]:
        """The live cache entries (not yet expired at ``clock()``), shortest prefix first."""
        now = self.clock()
        with self._lock:
            return sorted((e for e in self._cache.values() if e.expires_at > now), key=lambda e: e.tokens)

    # -- HTTP --------------------------------------------------------------------------------------------------

    def _handle(self, call: Call) -> JsonReply:
        request_id = f"req_fake_{next(self._ids):06d}"
        try:
            status, body = self._route(call)
        except FakeAnthropicError as error:
            status, body = error.status, {"type": "error", "error": {"type": error.kind, "message": error.message},
                                          "request_id": request_id}
        return JsonReply(status, body, {"request-id": request_id})

    def _route(self, call: Call) -> tuple[int, Any]:
        if call.method == "POST" and call.path == "/v1/messages":
            with self._lock:
                self.requests.append(call.body)
            return 200, self._messages(self._scope(call), call.body)
        if call.method == "POST" and call.path == "/v1/messages/count_tokens":
            self._scope(call)
            body = _check_body(call.body, COUNT_FIELDS, ("model", "messages"))
            return 200, {"input_tokens": self.count(body)}
        if call.method == "GET" and call.path.startswith("/v1/models"):
            self._scope(call)
            return 200, self._models(call)
        raise FakeAnthropicError(404, "not_found_error", "Not Found")

    @staticmethod
    def _scope(call: Call) -> str:
        bearer = call.headers.get("authorization", "")
        key = call.headers.get("x-api-key") or (bearer[7:] if bearer.lower().startswith("bearer ") else "")
        if not key:
            raise FakeAnthropicError(401, "authentication_error", "x-api-key header is required")
        if not call.headers.get("anthropic-version"):
            raise _invalid("anthropic-version: header is required")
        return key

    def _messages(self, scope: str, raw: Any) -> Mapping[str, Any]:
        body = _check_body(raw, MESSAGES_FIELDS, ("model", "messages", "max_tokens"))
        max_tokens, model = _check_max_tokens(body["max_tokens"]), str(body["model"])
        if not model.startswith("claude-"):
            raise FakeAnthropicError(404, "not_found_error", f"model: {model}")
        if body.get("stream"):
            raise _invalid("stream: streaming is not implemented by this fake")
        blocks = _blocks(body)
        total = sum(b.tokens for b in blocks)
        if total > self.window(model):
            raise _invalid(f"prompt is too long: {total} tokens > {self.window(model)} maximum")
        usage = self._serve_cache(scope, model, blocks)
        return self._answer(model, usage, max_tokens)

    def _answer(self, model: str, usage: _Usage, max_tokens: int) -> Mapping[str, Any]:
        text, output_tokens, stop_reason = _reply_text(max_tokens)
        return {
            "id": f"msg_fake_{next(self._ids):06d}", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason, "stop_sequence": None,
            "usage": {"input_tokens": usage.uncached, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": usage.write_5m + usage.write_1h,
                      "cache_read_input_tokens": usage.read,
                      "cache_creation": {"ephemeral_5m_input_tokens": usage.write_5m,
                                         "ephemeral_1h_input_tokens": usage.write_1h}}}

    # -- the cache ---------------------------------------------------------------------------------------------

    def _serve_cache(self, scope: str, model: str, blocks: list[_Block]) -> _Usage:
        ends = list(itertools.accumulate(b.tokens for b in blocks))
        marks = [i for i, b in enumerate(blocks) if b.ttl]
        now = self.clock()
        with self._lock:
            hit = self._read(scope, model, blocks, marks, now)
            written = self._write(scope, model, blocks, ends, marks, hit, now)
        read = ends[hit] if hit >= 0 else 0
        return _Usage(read, written["5m"], written["1h"], (ends[-1] if ends else 0) - read - sum(written.values()))

    def _read(self, scope: str, model: str, blocks: list[_Block], marks: list[int], now: float) -> int:
        """The last block of the longest live prefix found at a breakpoint or in its lookback (-1: none)."""
        looked = {j for b in marks for j in range(max(b - LOOKBACK_BLOCKS, 0), b + 1)}
        for j in sorted(looked, reverse=True):
            key = (scope, model, blocks[j].digest)
            entry = self._cache.get(key)
            if entry is not None and entry.expires_at > now:
                ttl = "1h" if "1h" in (entry.ttl, blocks[j].ttl) else "5m"
                self._cache[key] = replace(entry, ttl=ttl, expires_at=now + TTL_SECONDS[ttl])
                return j
        return -1

    def _write(self, scope: str, model: str, blocks: list[_Block], ends: list[int], marks: list[int], hit: int,
               now: float) -> dict[str, int]:
        """Writes every breakpoint past the read that reaches the minimum; the tokens written, per TTL."""
        written, start = {"5m": 0, "1h": 0}, ends[hit] if hit >= 0 else 0
        for b in marks:
            ttl = blocks[b].ttl
            if b <= hit or ttl is None or ends[b] < self.min_cacheable(model):
                continue
            self._cache[(scope, model, blocks[b].digest)] = CacheEntry(
                scope, model, blocks[b].digest, ends[b], ttl, now + TTL_SECONDS[ttl])
            written[ttl], start = written[ttl] + ends[b] - start, ends[b]
        return written

    # -- the Models API ----------------------------------------------------------------------------------------

    def _model(self, model_id: str) -> Mapping[str, Any]:
        for known, name, created in self.models:
            if model_id == known or re.fullmatch(re.escape(model_id) + r"-\d{8}", known):
                return {"id": known, "type": "model", "display_name": name, "created_at": created}
        raise FakeAnthropicError(404, "not_found_error", f"model: {model_id}")

    def _models(self, call: Call) -> Mapping[str, Any]:
        if call.path.startswith("/v1/models/"):
            return self._model(call.path.removeprefix("/v1/models/"))
        if call.path != "/v1/models":
            raise FakeAnthropicError(404, "not_found_error", "Not Found")
        ids = [m[0] for m in self.models]
        after, before = (call.query.get(k, [""])[0] for k in ("after_id", "before_id"))
        start = ids.index(after) + 1 if after in ids else 0
        stop = ids.index(before) if before in ids else len(ids)
        limit = call.query.get("limit", ["20"])[0]
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            raise _invalid("limit: Input should be between 1 and 1000")
        page = [self._model(i) for i in ids[start:stop][:int(limit)]]
        return {"data": page, "has_more": start + len(page) < stop,
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
