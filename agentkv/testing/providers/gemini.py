"""A fake of the Gemini API (Google AI Studio, ``generativelanguage.googleapis.com/v1beta``): generateContent,
countTokens and explicit context caching (``cachedContents``), with implicit caching as a best effort.

Sources: https://ai.google.dev/api/generate-content, https://ai.google.dev/api/tokens, https://ai.google.dev/api/caching,
https://ai.google.dev/gemini-api/docs/caching, and litellm 1.110.2's Gemini code (``llms/vertex_ai/vertex_llm_base.py``,
``llms/vertex_ai/gemini/``, ``llms/vertex_ai/context_caching/``, ``llms/gemini/count_tokens/handler.py``), which
is what the tests drive against it.

Addressing: ``FakeGemini.url`` (``http://127.0.0.1:PORT/v1beta``) is the ``api_base`` of
``litellm.completion(model="gemini/<model>")``, which posts ``{api_base}/models/<model>:generateContent`` and
``{api_base}/cachedContents``; ``litellm.acount_tokens`` appends ``v1beta/models/<model>:countTokens`` itself, so
it takes ``FakeGemini.root``. The key comes in ``x-goog-api-key`` (what litellm sends) or the ``key`` query param.

* ``models/{model}:generateContent``: ``contents``, ``systemInstruction``, ``tools``, ``toolConfig``,
  ``generationConfig.maxOutputTokens``, ``cachedContent`` (snake_case too, as Google accepts and litellm sends).
  The answer is ``reply`` cut to maxOutputTokens (``MAX_TOKENS``, else ``STOP``) with ``usageMetadata``
  {prompt/candidates/totalTokenCount, promptTokensDetails, and when cached cachedContentTokenCount and
  cacheTokensDetails}. A live ``cachedContent`` is the prompt's prefix (counted in promptTokenCount). Beside it a
  request may not set systemInstruction, tools or toolConfig, nor use another model (400); an unknown, expired,
  deleted or other key's name answers 403 "CachedContent not found (or permission denied)" as AI Studio does.
  Over the model's window: 400.
* Implicit caching (Gemini 2.5's default), best effort: a request without ``cachedContent`` sharing a rendered
  prefix of at least the model's minimum with one of the last 16 prompts (same key and model, within 5 minutes)
  reports that prefix as cachedContentTokenCount. Google guarantees no hit; this fake always hits then.
* ``models/{model}:countTokens``: ``{contents}`` or ``{generateContentRequest}`` -> ``{totalTokens,
  promptTokensDetails, cachedContentTokenCount?}``; totalTokens is the promptTokenCount generateContent would bill.
* ``cachedContents``: create (``model: "models/..."``, contents, systemInstruction, tools, toolConfig, ``ttl:
  "300s"`` or ``expireTime`` (default one hour), displayName; under the minimum: 400 "Cached content is too small.
  total_token_count=N, min_total_token_count=M"), list (``pageSize`` 50 by default, ``pageToken``; ``{}`` when
  empty), get, patch (ttl/expireTime), delete. Caches belong to the key that created them.

Minimums (explicit and implicit): 2048 for gemini-2.5-pro, 1024 for the 2.5 Flash models: litellm's cost map
(``prompt_cache_min_tokens``, default 1024), so litellm's pre-check and the fake agree. Google's caching page has
said 1024/2048, 1024/4096 and 2048/2048 (Flash/Pro) over time.

Token counting (deterministic): each turn (systemInstruction as role "system", then each content) costs 3 (open,
role, close) plus its parts: a text part ``fake_tokens(text)``, any other part per sorted key the key plus
``fake_tokens`` of the value's sorted JSON; ``tools`` and ``toolConfig`` cost 2 plus ``fake_tokens`` of their
sorted JSON. Order: system, tools, toolConfig, contents; a cache renders the same way before the request's
contents. Keys are camelCased first, so both spellings count alike. Storage: ``storage_token_hours()`` sums each
cache's totalTokenCount x hours from creation to deletion, expiry or now.

What this fake leaves out: Vertex AI (``projects/.../locations/...`` paths, OAuth, its v1/v1beta1 cache resources
and minimums), streaming (``streamGenerateContent`` answers 501), ``models`` listing (models outside ``windows``
answer 404), real tokenization, multimodal parts priced by modality (images, audio, video and files count as their
JSON), thinking (no thoughtsTokenCount, thought parts or signatures), function calling (the answer is always
text), safety ratings and blocking, candidateCount > 1, stop sequences, sampling, structured output, grounding,
the real implicit-cache heuristics (block granularity, routing, eviction), content-size limits and cache quotas,
``updateMask`` checking, storage billed per second at the published price (only token-hours are reported), rate
limits, and the exact text of Google's errors beyond those quoted above.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator, Mapping

from agentkv.testing.providers.server import Call, FakeServer, JsonReply, fake_tokens

__all__ = ["CACHE_MIN_TOKENS", "CachedContent", "DEFAULT_WINDOW", "FakeGemini"]

DEFAULT_WINDOW = 1_048_576
DEFAULT_TTL_S = 3600.0
IMPLICIT_REUSE_S = 300.0
IMPLICIT_MEMORY = 16
CACHE_MIN_TOKENS: Mapping[str, int] = {"gemini-2.5-pro": 2048, "gemini-2.5-flash": 1024, "gemini-2.5-flash-lite": 1024}
DEFAULT_CACHE_MIN_TOKENS = 1024
DEFAULT_REPLY = "This is the fake Gemini's answer to your request."
_PAGE_SIZE, _MAX_PAGE_SIZE = 50, 1000
_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 501: "UNIMPLEMENTED"}
_MODEL_PATH = re.compile(r"/v1beta/models/([^/:]+):(\w+)")
_CACHES_PATH = "/v1beta/cachedContents"
_CACHE_PATH = re.compile(r"/v1beta/(cachedContents/[^/]+)")
_TTL = re.compile(r"(\d+(?:\.\d{1,9})?)s")
_FRACTION = re.compile(r"\.(\d{1,6})\d*")
_NOT_FOUND = "CachedContent not found (or permission denied)"
_NO_KEY = ("Method doesn't allow unregistered callers (callers without established identity). Please use API Key "
           "or other form of API consumer identity to call this API.")
_BESIDE_CACHE = ("CachedContent can not be used with GenerateContent request setting system_instruction, tools or "
                 "tool_config.\n\nProposed fix: move those values to CachedContent from GenerateContent request.")


class _Refusal(ValueError):
    """An error answer in Google's format: ``{"error": {"code", "message", "status"}}`` (``count`` raises it)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    def reply(self) -> JsonReply:
        return JsonReply(self.code, {"error": {"code": self.code, "message": self.message, "status": _STATUS[self.code]}})


@dataclass
class CachedContent:
    """One explicit cache as the fake holds it (``tokens`` is its rendering; ``ended`` is set on delete/expiry)."""

    name: str
    model: str  # "models/<id>"
    display_name: str | None
    key: str
    tokens: tuple[str, ...]
    created: float
    updated: float
    expires: float
    ended: float | None = None

    def resource(self) -> dict[str, Any]:
        """The documented CachedContent resource (input-only fields are never returned)."""
        body: dict[str, Any] = {"name": self.name, "model": self.model}
        if self.display_name is not None:
            body["displayName"] = self.display_name
        body.update(usageMetadata={"totalTokenCount": len(self.tokens)}, createTime=_rfc3339(self.created),
                    updateTime=_rfc3339(self.updated), expireTime=_rfc3339(self.expires))
        return body

    def token_hours(self, now: float) -> float:
        end = min(now, self.expires, now if self.ended is None else self.ended)
        return len(self.tokens) * max(0.0, end - self.created) / 3600.0


class FakeGemini:
    """The fake Gemini API on 127.0.0.1; use it in a ``with`` block and pass ``url`` as litellm's ``api_base``.

    ``clock`` gives epoch seconds (expireTime is wall-clock RFC 3339); ``windows`` maps the served model ids to
    their context windows; ``cache_min_tokens`` overrides per-model minimums; ``api_keys`` (None: any non-empty
    key) are the keys accepted; ``reply`` is every answer's text; ``implicit`` turns implicit caching on.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time, windows: Mapping[str, int] | None = None,
                 cache_min_tokens: Mapping[str, int] | None = None, api_keys: Iterable[str] | None = None,
                 reply: str = DEFAULT_REPLY, implicit: bool = True) -> None:
        self.clock = clock
        self.windows = dict(windows if windows is not None else {m: DEFAULT_WINDOW for m in CACHE_MIN_TOKENS})
        self.cache_min_tokens = {**CACHE_MIN_TOKENS, **(cache_min_tokens or {})}
        self.api_keys = None if api_keys is None else frozenset(api_keys)
        self.reply, self.implicit = reply, implicit
        self.server = FakeServer(self._handle, clock=clock)
        self.deleted: list[str] = []  # names removed by DELETE
        self.expired: list[str] = []  # names that reached their expireTime
        self._caches: dict[str, CachedContent] = {}
        self._ended: list[CachedContent] = []
        self._recent: deque[tuple[float, str, str, tuple[str, ...]]] = deque(maxlen=IMPLICIT_MEMORY)
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    def __enter__(self) -> "FakeGemini":
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT/v1beta``: litellm's ``api_base`` for ``gemini/`` completions."""
        return self.server.url + "/v1beta"

    @property
    def root(self) -> str:
        """``http://127.0.0.1:PORT``: the ``api_base`` of ``litellm.acount_tokens`` (it appends ``v1beta/...``)."""
        return self.server.url

    @property
    def calls(self) -> list[Call]:
        return self.server.calls

    @property
    def requests(self) -> list[Any]:
        """The bodies of every generateContent received, as sent."""
        return [c.body for c in self.calls if c.method == "POST" and c.path.endswith(":generateContent")]

    def caches(self) -> list[CachedContent]:
        """The live caches (expired ones swept first), oldest first."""
        with self._lock:
            self._sweep()
            return list(self._caches.values())

    def count(self, body: Mapping[str, Any]) -> int:
        """The fake's count of the prompt of a generateContent or countTokens body (a named live cache included)."""
        with self._lock:
            self._sweep()
            return len(self._count_request(_camel(dict(body)), None)[0])

    def storage_token_hours(self) -> float:
        """Cached tokens x hours stored, over every cache created so far (live ones up to now)."""
        with self._lock:
            now = self.clock()
            return sum(c.token_hours(now) for c in itertools.chain(self._caches.values(), self._ended))

    # -- dispatch -------------------------------------------------------------------------------------------

    def _handle(self, call: Call) -> JsonReply:
        key = call.headers.get("x-goog-api-key") or next(iter(call.query.get("key", [])), "")
        try:
            if not key:
                raise _Refusal(403, _NO_KEY)
            if self.api_keys is not None and key not in self.api_keys:
                raise _Refusal(400, "API key not valid. Please pass a valid API key.")
            with self._lock:
                self._sweep()
                return self._route(call, key)
        except _Refusal as refusal:
            return refusal.reply()

    def _route(self, call: Call, key: str) -> JsonReply:
        model_call = _MODEL_PATH.fullmatch(call.path)
        if model_call and call.method == "POST":
            return self._model_action(model_call.group(1), model_call.group(2), _body(call), key)
        if call.path == _CACHES_PATH and call.method in ("GET", "POST"):
            return self._create(_body(call), key) if call.method == "POST" else self._list(call, key)
        cache_call = _CACHE_PATH.fullmatch(call.path)
        if cache_call and call.method in ("GET", "PATCH", "DELETE"):
            return self._one_cache(call, cache_call.group(1), key)
        raise _Refusal(404, f"{call.method} {call.path} is not a method of this fake of the Gemini API.")

    def _model_action(self, model: str, action: str, body: dict[str, Any], key: str) -> JsonReply:
        self._served(model, action)
        if action == "generateContent":
            return self._generate(model, body, key)
        if action == "countTokens":
            return self._count_tokens(model, body, key)
        raise _Refusal(501, f"{action} is not implemented by this fake (generateContent and countTokens are).")

    # -- generateContent / countTokens ----------------------------------------------------------------------

    def _generate(self, model: str, body: dict[str, Any], key: str) -> JsonReply:
        if not body.get("contents"):
            raise _Refusal(400, "* GenerateContentRequest.contents: contents is not specified\n")
        tokens, cached = self._prompt(model, body, key)
        self._fits(model, len(tokens))
        if not cached and self.implicit:
            cached = self._implicit_hit(model, key, tokens)
        self._recent.append((self.clock(), key, model, tokens))
        text, reason = _answer(self.reply, (body.get("generationConfig") or {}).get("maxOutputTokens"))
        return JsonReply(200, {
            "candidates": [{"content": {"parts": [{"text": text}], "role": "model"}, "finishReason": reason, "index": 0}],
            "usageMetadata": _usage(len(tokens), cached, len(fake_tokens(text))),
            "modelVersion": model, "responseId": f"fake-{next(self._ids):08d}"})

    def _prompt(self, model: str, body: dict[str, Any], key: str | None) -> tuple[tuple[str, ...], int]:
        own = _render(body)
        name = body.get("cachedContent")
        if name is None:
            return own, 0
        if any(body.get(field) for field in ("systemInstruction", "tools", "toolConfig")):
            raise _Refusal(400, _BESIDE_CACHE)
        cache = self._cache(name, key)
        if cache.model != f"models/{model}":
            raise _Refusal(400, f"Model used by GenerateContent request (models/{model}) and CachedContent "
                                f"({cache.model}) has to be the same.")
        return cache.tokens + own, len(cache.tokens)

    def _count_tokens(self, model: str, body: dict[str, Any], key: str) -> JsonReply:
        tokens, cached = self._count_request(body, key, model)
        answer: dict[str, Any] = {"totalTokens": len(tokens),
                                  "promptTokensDetails": [{"modality": "TEXT", "tokenCount": len(tokens)}]}
        if cached:
            answer["cachedContentTokenCount"] = cached
        return JsonReply(200, answer)

    def _count_request(self, body: dict[str, Any], key: str | None, model: str | None = None
                       ) -> tuple[tuple[str, ...], int]:
        inner = body.get("generateContentRequest")
        if inner is not None and "contents" in body:
            raise _Refusal(400, "contents and generate_content_request are mutually exclusive.")
        request = inner if isinstance(inner, dict) else body
        name = str(request.get("model") or f"models/{model or ''}").removeprefix("models/")
        if request.get("cachedContent") is not None and not name:
            name = self._cache(request["cachedContent"], key).model.removeprefix("models/")
        return self._prompt(name, request, key)

    def _implicit_hit(self, model: str, key: str, tokens: tuple[str, ...]) -> int:
        now, minimum = self.clock(), self._minimum(model)
        shared = [_common_prefix(tokens, seen) for at, owner, used, seen in self._recent
                  if (owner, used) == (key, model) and now - at <= IMPLICIT_REUSE_S]
        best = max(shared, default=0)
        return best if best >= minimum else 0

    # -- cachedContents -------------------------------------------------------------------------------------

    def _create(self, body: dict[str, Any], key: str) -> JsonReply:
        model = str(body.get("model") or "")
        if not model.startswith("models/"):
            raise _Refusal(400, "* CreateCachedContentRequest.cached_content.model: model is not specified, or not "
                                "in the form models/{model}\n")
        model_id = model.removeprefix("models/")
        self._served(model_id, "createCachedContent")
        tokens = _render(body)
        if len(tokens) < self._minimum(model_id):
            raise _Refusal(400, f"Cached content is too small. total_token_count={len(tokens)}, "
                                f"min_total_token_count={self._minimum(model_id)}")
        self._fits(model_id, len(tokens))
        now = self.clock()
        name = f"cachedContents/fake{next(self._ids):08d}"
        display = body.get("displayName")
        cache = CachedContent(name, model, None if display is None else str(display), key, tokens, now, now,
                              _expiry(body, now, required=False))
        self._caches[name] = cache
        return JsonReply(200, cache.resource())

    def _list(self, call: Call, key: str) -> JsonReply:
        size = _int_param(call, "pageSize", _PAGE_SIZE)
        start = _int_param(call, "pageToken", 0)
        if size < 0 or start < 0:
            raise _Refusal(400, "Invalid pageSize or pageToken.")
        own = [c for c in self._caches.values() if c.key == key]
        page = own[start:start + min(size or _PAGE_SIZE, _MAX_PAGE_SIZE)]
        answer: dict[str, Any] = {"cachedContents": [c.resource() for c in page]} if page else {}
        if start + len(page) < len(own):
            answer["nextPageToken"] = str(start + len(page))
        return JsonReply(200, answer)

    def _one_cache(self, call: Call, name: str, key: str) -> JsonReply:
        cache = self._cache(name, key)
        if call.method == "DELETE":
            self._end(cache, self.clock(), self.deleted)
            return JsonReply(200, {})
        if call.method == "PATCH":
            now = self.clock()
            cache.expires, cache.updated = _expiry(_body(call), now, required=True), now
        return JsonReply(200, cache.resource())

    def _cache(self, name: object, key: str | None) -> CachedContent:
        cache = self._caches.get(name) if isinstance(name, str) else None
        if cache is None or (key is not None and cache.key != key):
            raise _Refusal(403, _NOT_FOUND)
        return cache

    def _sweep(self) -> None:
        now = self.clock()
        for cache in [c for c in self._caches.values() if c.expires <= now]:
            self._end(cache, cache.expires, self.expired)

    def _end(self, cache: CachedContent, at: float, record: list[str]) -> None:
        cache.ended = at
        del self._caches[cache.name]
        self._ended.append(cache)
        record.append(cache.name)

    # -- model facts ----------------------------------------------------------------------------------------

    def _served(self, model: str, action: str) -> None:
        if model not in self.windows:
            raise _Refusal(404, f"models/{model} is not found for API version v1beta, or is not supported for "
                                f"{action}. Call ListModels to see the list of available models and their "
                                "supported methods.")

    def _fits(self, model: str, tokens: int) -> None:
        if tokens > self.windows[model]:
            raise _Refusal(400, f"The input token count ({tokens}) exceeds the maximum number of tokens allowed "
                                f"({self.windows[model]}).")

    def _minimum(self, model: str) -> int:
        return self.cache_min_tokens.get(model, DEFAULT_CACHE_MIN_TOKENS)


# -- rendering and helpers ----------------------------------------------------------------------------------


def _render(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The fake's token rendering of a prompt: system, tools, toolConfig, then contents (see the module doc)."""
    out: list[str] = []
    if body.get("systemInstruction") is not None:
        out += _turn("system", body["systemInstruction"])
    for block in ("tools", "toolConfig"):
        if body.get(block):
            out += [f"<{block}>", *fake_tokens(_json(body[block])), "</>"]
    contents = body.get("contents") or []
    if not isinstance(contents, list):
        raise _Refusal(400, "Invalid JSON payload received. contents must be a list of Content.")
    for content in contents:
        out += _turn(str(content.get("role") or "user") if isinstance(content, dict) else "", content)
    return tuple(out)


def _turn(role: str, content: object) -> list[str]:
    parts = content.get("parts") if isinstance(content, dict) else None
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise _Refusal(400, "Invalid JSON payload received. A Content needs a list of parts.")
    return ["<turn>", role, *itertools.chain.from_iterable(_part(p) for p in parts), "</turn>"]


def _part(part: Mapping[str, Any]) -> Iterator[str]:
    if isinstance(part.get("text"), str) and len(part) == 1:
        yield from fake_tokens(part["text"])
        return
    for name in sorted(part):
        yield name
        yield from fake_tokens(part[name] if isinstance(part[name], str) else _json(part[name]))


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _camel(value: Any) -> Any:
    """snake_case keys -> camelCase, recursively (Google's JSON parser accepts both; litellm sends both)."""
    if isinstance(value, dict):
        return {re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), k): _camel(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_camel(v) for v in value]
    return value


def _body(call: Call) -> dict[str, Any]:
    if call.body is None:
        return {}
    if not isinstance(call.body, dict):
        raise _Refusal(400, "Invalid JSON payload received. Expected an object.")
    return dict(_camel(call.body))


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _answer(reply: str, cap: object) -> tuple[str, str]:
    tokens = fake_tokens(reply)
    if not isinstance(cap, int) or cap >= len(tokens):
        return reply, "STOP"
    end = 0
    for token in tokens[:max(cap, 0)]:
        end = reply.index(token, end) + len(token)
    return reply[:end], "MAX_TOKENS"


def _usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    usage: dict[str, Any] = {"promptTokenCount": prompt, "candidatesTokenCount": output,
                             "totalTokenCount": prompt + output,
                             "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}]}
    if cached:
        usage.update(cachedContentTokenCount=cached, cacheTokensDetails=[{"modality": "TEXT", "tokenCount": cached}])
    return usage


def _expiry(body: Mapping[str, Any], now: float, *, required: bool) -> float:
    ttl, expire_time = body.get("ttl"), body.get("expireTime")
    if ttl is not None and expire_time is not None:
        raise _Refusal(400, "Only one of ttl or expire_time may be set.")
    if ttl is None and expire_time is None:
        if required:
            raise _Refusal(400, "Either ttl or expire_time must be set.")
        return now + DEFAULT_TTL_S
    match = _TTL.fullmatch(ttl) if isinstance(ttl, str) else None
    if ttl is not None and match is None:
        raise _Refusal(400, f"Invalid value at 'cached_content.ttl' (google.protobuf.Duration), {ttl!r}")
    at = now + float(match.group(1)) if match is not None else _parse_time(expire_time)
    if at <= now:
        raise _Refusal(400, "The expiration time must be in the future.")
    return at


def _parse_time(value: object) -> float:
    try:
        text = _FRACTION.sub(lambda m: "." + m.group(1), str(value).replace("Z", "+00:00"), count=1)
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise _Refusal(400, f"Invalid value at 'cached_content.expire_time' (type.googleapis.com/google.protobuf"
                            f".Timestamp), {value!r}") from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _int_param(call: Call, name: str, default: int) -> int:
    value = next(iter(call.query.get(name, [])), None)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise _Refusal(400, f"Invalid {name}: {value!r}") from None
