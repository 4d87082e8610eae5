"""Exact counts from the server itself: vLLM's ``POST /tokenize``, chat form.

    source = ServerSource(Backend("hosted_vllm/m", api_base="http://127.0.0.1:8001/v1"))
    source.count(payload)        # or, in a machine: yield from source.counting(payload)
"""

from __future__ import annotations

from urllib.parse import urlsplit

import threading
from typing import Any, Mapping

from cachetools import LRUCache

from agentkv._support.effects import Call, Machine, Raised, run
from agentkv.http.transport import HttpError, HttpTransport, default_http
from agentkv.backends import Backend
from agentkv.events import digest, emit
from agentkv.tokens.breaker import CircuitBreaker, shared_breaker
from agentkv.tokens.payload import CountUnavailable, Payload, TokenCount
from agentkv.telemetry.otel import ended, span_in

__all__ = ["DEFAULT_TOKENIZE_TIMEOUT_S", "ServerSource"]

# /tokenize is a fast call (a tokenizer pass on the server); a server that takes longer is treated as
# failing and its breaker opens (:mod:`agentkv.tokens.breaker`).
DEFAULT_TOKENIZE_TIMEOUT_S = 2.0


class ServerSource:
    """Exact counts from vLLM's ``POST /tokenize`` (chat form), cached per payload digest.

    ``http`` is the HTTP seam (:func:`agentkv.http.transport.default_http` unless given). A server without
    ``/tokenize`` (404/405) is remembered and not asked again by this source. A timeout, a failed
    connection or a 5xx opens ``breaker`` (by default the process's breaker for this URL,
    :func:`~agentkv.tokens.breaker.shared_breaker`): until its back-off ends, the source is not asked
    and the counter's next source answers. Each call is a machine (:meth:`counting`, :meth:`ids`) whose one
    HTTP request is an effect, driven sync or async by its caller; the sync methods run it.
    """

    name = "server"

    def __init__(self, backend: Backend, *, http: HttpTransport | None = None,
                 timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S, maxsize: int = 512,
                 breaker: CircuitBreaker | None = None) -> None:
        self._backend = backend
        self._url = self.endpoint(backend)
        self._http = http or default_http()
        self._timeout_s = timeout_s
        self.breaker = breaker or shared_breaker(self._url)
        self._memo: LRUCache[str, dict[str, Any]] = LRUCache(maxsize)
        self._lock = threading.Lock()
        self.unsupported = False
        self.last_max_model_len: int | None = None

    def endpoint(self, backend: Backend) -> str:
        """Where this source asks: the server's ``/tokenize``."""
        if backend.server_root is None:
            raise CountUnavailable(f"backend {backend.label!r} has no api_base to ask /tokenize")
        return f"{backend.server_root}/tokenize"

    def headers(self) -> dict[str, str] | None:
        """Headers the count call carries (none for vLLM's ``/tokenize``)."""
        return None

    def request_body(self, payload: Payload, **overrides: Any) -> dict[str, Any]:
        """The chat-form (or prompt-form) /tokenize body for this payload."""
        if payload.messages is None:
            return {"model": self._backend.served_model, "prompt": payload.prompt or "", **overrides}
        body: dict[str, Any] = {"model": self._backend.served_model, "messages": [dict(m) for m in payload.messages],
                                "add_generation_prompt": True}
        if payload.tools:
            body["tools"] = list(payload.tools)
        if payload.tools and payload.tool_choice is not None:
            body["tool_choice"] = payload.tool_choice  # templates may render it; vLLM ignores the field
        if payload.template_kwargs:
            body["chat_template_kwargs"] = dict(payload.template_kwargs)
        body.update(overrides)
        return body

    def tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The server's answer for ``body``, from the cache when the same body was sent before."""
        return run(self.tokenizing(body))

    def tokenizing(self, body: Mapping[str, Any]) -> Machine[dict[str, Any]]:
        """:meth:`tokenize` as a machine (its one HTTP call an effect): sync and async callers drive it alike."""
        key, cached = self._remembered(body)
        if cached is not None:
            return cached
        self._admit()
        span = span_in(None, "agentkv.count", self._span_attributes(), kind="CLIENT")
        answer = yield Call(self._http.request, self._http.arequest, ("POST", self._url),
                            {"json": dict(body), "timeout_s": self._timeout_s, "headers": self.headers()},
                            captures=True)
        if isinstance(answer, Raised):
            ended(span, error=answer.error)
            if isinstance(answer.error, HttpError):
                raise self._unavailable(answer.error) from answer.error
            raise answer.error
        self.breaker.succeeded()
        found = self._remember(key, self._checked(answer.value))
        ended(span, attributes={"agentkv.tokens.exact": found.get("count")})
        return found

    def _span_attributes(self) -> dict[str, Any]:
        """A count call's span: the source and the server asked (its path only)."""
        return {"agentkv.count.source": self.name, "url.path": urlsplit(self._url).path}

    def count(self, payload: Payload) -> TokenCount:
        return run(self.counting(payload))

    def counting(self, payload: Payload) -> Machine[TokenCount]:
        """:meth:`count` as a machine."""
        total = (yield from self.tokenizing(self.request_body(payload)))["count"]
        probes = []
        for body in self._tool_probes(payload):
            probes.append((yield from self.tokenizing(body))["count"])
        return self._count(total, probes)

    def token_ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> list[int]:
        """The server's token ids for the payload."""
        return run(self.ids(payload, add_generation_prompt=add_generation_prompt))

    def ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> Machine[list[int]]:
        """:meth:`token_ids` as a machine."""
        body = self.request_body(payload, add_generation_prompt=add_generation_prompt)
        return list((yield from self.tokenizing(body)).get("tokens") or [])

    def _count(self, total: int, probes: list[int]) -> TokenCount:
        tools = max(0, probes[0] - probes[1]) if probes else 0
        return TokenCount(total, total, min(tools, total), self.name, True)

    def _tool_probes(self, payload: Payload) -> list[dict[str, Any]]:
        """Two /tokenize bodies whose counts differ by the tool schemas' tokens (none without tools)."""
        if not payload.tools or payload.messages is None:
            return []
        probe = ({"role": "user", "content": ""},)
        return [self.request_body(Payload(probe, payload.tools), add_generation_prompt=False),
                self.request_body(Payload(probe), add_generation_prompt=False)]

    def _remembered(self, body: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
        if self.unsupported:
            raise CountUnavailable("server has no /tokenize")
        key = digest(body, 24)
        with self._lock:
            return key, self._memo.get(key)

    def _remember(self, key: str, answer: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._memo[key] = answer
        return answer

    def _admit(self) -> None:
        if not self.breaker.allow():
            raise CountUnavailable("/tokenize circuit open after a recent timeout or server error")

    def _unavailable(self, exc: HttpError) -> CountUnavailable:
        if exc.status_code in (401, 403, 404, 405):  # no such endpoint, or not for this key: not asked again
            self.unsupported = True
        if exc.status_code is None or exc.status_code >= 500 or exc.status_code == 429:  # no answer, or a failing one
            self.breaker.failed()
            emit("count_source_breaker_open", level="warning", source=self.name, backend=self._backend.label,
                 status=exc.status_code, timed_out=exc.kind == "timeout")
        else:
            self.breaker.succeeded()  # it answered: the server is up, this body was refused
        return CountUnavailable(f"{self.name} count failed: {exc}")

    def _checked(self, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, Mapping) or not isinstance(answer.get("count"), int):
            raise CountUnavailable("/tokenize answered without an integer 'count'")
        self.last_max_model_len = answer.get("max_model_len") or self.last_max_model_len
        return dict(answer)
