"""The HTTP seam served by one function, for tests: :class:`FakeHttp` answers the sync, the async and the raw
path alike, and records every call.

    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    WindowDiscovery(http=http); Session(..., http=http)
    assert not http.blocking_calls             # no sync HTTP call was made on a running event loop
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from agentkv.http.transport import HttpError

__all__ = ["FakeAnswer", "FakeHttp", "HttpCall", "models_answer"]


@dataclass(frozen=True)
class HttpCall:
    """One request a :class:`FakeHttp` served; ``blocking`` is True for a sync call made while an event
    loop was running on the calling thread (a call that stalls every coroutine)."""

    method: str
    url: str
    body: Any
    asynchronous: bool
    blocking: bool
    headers: Mapping[str, str] = field(default_factory=dict)  # what the caller set (the transport adds its own)


Handler = Callable[[str, str, Any], Any]


class FakeHttp:
    """The HTTP seam (:class:`agentkv.HttpTransport`) served by one handler: sync, async and raw alike.

    ``handler(method, url, body)`` returns the JSON answer (the text, for ``text=True``), or ``(status, answer)``;
    it may raise :class:`agentkv.HttpError` (``kind="status"`` with a status, ``kind="timeout"``,
    ``kind="outage"``...). ``latency_s`` delays each answer (``time.sleep`` on the sync path, ``asyncio.sleep`` on
    the async one; past a call's ``timeout_s`` it is an ``HttpError`` of kind "timeout"). Every call is recorded.

    A raw :meth:`post` (the gateway's relayed requests) hands the handler the parsed JSON body; its answer is
    ``(status, answer)`` or the answer alone (200): a JSON value, ``bytes`` as they are, or a list of ``bytes``
    passed on as a stream (``text/event-stream``) one chunk at a time. The handler may raise :class:`HttpError`
    (``kind="outage"``), as a transport that could not reach the backend does.
    """

    def __init__(self, handler: Handler, *, latency_s: float = 0.0) -> None:
        self.handler = handler
        self.latency_s = latency_s
        self.calls: list[HttpCall] = []
        self._lock = threading.Lock()

    @property
    def blocking_calls(self) -> list[HttpCall]:
        """Sync calls made while an event loop ran on the calling thread."""
        with self._lock:
            return [c for c in self.calls if c.blocking]

    def request(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                timeout_s: float, text: bool = False) -> Any:
        self._record(HttpCall(method, url, json, False, _loop_running(), dict(headers or {})))
        if self.latency_s:
            time.sleep(min(self.latency_s, timeout_s))
            _check_timeout(self.latency_s, timeout_s, url)
        return _answer(self.handler(method, url, json), url, text)

    async def arequest(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                       timeout_s: float, text: bool = False) -> Any:
        self._record(HttpCall(method, url, json, True, False, dict(headers or {})))
        if self.latency_s:
            await asyncio.sleep(min(self.latency_s, timeout_s))
            _check_timeout(self.latency_s, timeout_s, url)
        return _answer(self.handler(method, url, json), url, text)

    async def post(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> "FakeAnswer":
        """A raw POST: the handler's answer as a :class:`FakeAnswer`, its body unread."""
        body = json.loads(content)
        self._record(HttpCall("POST", url, body, True, False, dict(headers or {})))
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        result = self.handler("POST", url, body)
        status, answer = result if isinstance(result, tuple) else (200, result)
        return FakeAnswer(status, answer)

    def start(self, url: str, content: bytes, headers: Mapping[str, str] | None = None) -> None:
        """None: the fake writes a request only when its answer is awaited (:meth:`post`)."""
        return None

    async def aclose(self) -> None:
        return None

    def _record(self, call: HttpCall) -> None:
        with self._lock:
            self.calls.append(call)


class FakeAnswer:
    """A raw answer of :class:`FakeHttp` (an :class:`agentkv.http.transport.HttpAnswer`): ``answer`` is a JSON
    value, ``bytes``, or a list of ``bytes`` chunks (a stream); ``closed`` says whether the caller closed it."""

    def __init__(self, status_code: int, answer: Any) -> None:
        self.status_code = status_code
        if isinstance(answer, list) and all(isinstance(chunk, bytes) for chunk in answer):
            self._chunks, kind = list(answer), "text/event-stream"
        else:
            raw = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            self._chunks, kind = [raw], "application/json"
        self.headers = {"content-type": kind}
        self.closed = False

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            if self.closed:
                return
            yield chunk

    async def aclose(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


def models_answer(model_id: str, max_model_len: int | None) -> dict[str, Any]:
    """vLLM's ``GET /v1/models`` answer for one served model."""
    entry: dict[str, Any] = {"id": model_id, "object": "model", "owned_by": "vllm", "root": model_id, "parent": None}
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return {"object": "list", "data": [entry]}


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _check_timeout(latency_s: float, timeout_s: float, url: str) -> None:
    if latency_s > timeout_s:
        raise HttpError(f"ReadTimeout from {url}", kind="timeout")


def _answer(result: Any, url: str, text: bool) -> Any:
    if isinstance(result, tuple):
        status, result = result
        if status >= 400:
            raise HttpError(f"{status} from {url}", kind="status", status_code=status)
    return str(result) if text else result
