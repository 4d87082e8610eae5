"""Helpers for testing agents that use agentkv: a fake clock, a fake HTTP seam, event capture, embedded servers.

    from agentkv.testing import FakeClock, FakeHttp, capture_events, embedded_servers

    with embedded_servers() as (fast, slow):          # two vLLM-compatible servers on 127.0.0.1
        with capture_events() as events:
            ...
        assert any(e["event"] == "route" for e in events)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, MutableMapping

from agentkv._http import HttpError

__all__ = ["FakeClock", "FakeHttp", "HttpCall", "ScriptedReplies", "ScriptedTransport", "capture_events",
           "embedded_servers", "models_answer", "redis_server"]


class FakeClock:
    """A monotonic clock that moves only when told: pass it as ``timer=``/``clock=``."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


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

    ``handler(method, url, body)`` returns the JSON answer (the text, for ``get_text``), or ``(status, answer)``;
    it may raise :class:`agentkv._http.HttpError` (a status, or ``timed_out=True``). ``latency_s`` delays each answer
    (``time.sleep`` on the sync path, ``asyncio.sleep`` on the async one). Every call is recorded.

    A raw :meth:`post` (the gateway's relayed requests) hands the handler the parsed JSON body; its answer is
    ``(status, answer)`` or the answer alone (200): a JSON value, ``bytes`` as they are, or a list of ``bytes``
    passed on as a stream (``text/event-stream``) one chunk at a time. The handler may raise httpx's errors
    (``httpx.ConnectError``...), as a transport that could not reach the backend does.

        http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
        WindowDiscovery(http=http); Session(..., http=http)
        assert not [c for c in http.calls if c.blocking]
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

    def get_json(self, url: str, *, timeout_s: float) -> Any:
        return self._sync("GET", url, None, timeout_s)

    def post_json(self, url: str, body: Any, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> Any:
        return self._sync("POST", url, body, timeout_s, headers)

    async def aget_json(self, url: str, *, timeout_s: float) -> Any:
        return await self._async("GET", url, None, timeout_s)

    def get_text(self, url: str, *, timeout_s: float) -> str:
        return str(self._sync("GET", url, None, timeout_s))

    async def aget_text(self, url: str, *, timeout_s: float) -> str:
        return str(await self._async("GET", url, None, timeout_s))

    async def apost_json(self, url: str, body: Any, *, timeout_s: float,
                         headers: Mapping[str, str] | None = None) -> Any:
        return await self._async("POST", url, body, timeout_s, headers)

    def call_json(self, method: str, url: str, body: Any = None, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> Any:
        return self._sync(method, url, body, timeout_s, headers)

    async def acall_json(self, method: str, url: str, body: Any = None, *, timeout_s: float,
                         headers: Mapping[str, str] | None = None) -> Any:
        return await self._async(method, url, body, timeout_s, headers)

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

    def _sync(self, method: str, url: str, body: Any, timeout_s: float,
              headers: Mapping[str, str] | None = None) -> Any:
        self._record(HttpCall(method, url, body, False, _loop_running(), dict(headers or {})))
        if self.latency_s:
            time.sleep(min(self.latency_s, timeout_s))
            _check_timeout(self.latency_s, timeout_s, url)
        return _answer(self.handler(method, url, body), url)

    async def _async(self, method: str, url: str, body: Any, timeout_s: float,
                     headers: Mapping[str, str] | None = None) -> Any:
        self._record(HttpCall(method, url, body, True, False, dict(headers or {})))
        if self.latency_s:
            await asyncio.sleep(min(self.latency_s, timeout_s))
            _check_timeout(self.latency_s, timeout_s, url)
        return _answer(self.handler(method, url, body), url)

    def _record(self, call: HttpCall) -> None:
        with self._lock:
            self.calls.append(call)


class FakeAnswer:
    """A raw answer of :class:`FakeHttp` (an :class:`agentkv._http.HttpAnswer`): ``answer`` is a JSON value, ``bytes``,
    or a list of ``bytes`` chunks (a stream); ``closed`` says whether the caller closed it."""

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
        raise HttpError(f"ReadTimeout from {url}", timed_out=True)


def _answer(result: Any, url: str) -> Any:
    if isinstance(result, tuple):
        status, body = result
        if status >= 400:
            raise HttpError(f"{status} from {url}", status_code=status)
        return body
    return result


@contextlib.contextmanager
def capture_events() -> Iterator[list[MutableMapping[str, Any]]]:
    """Capture agentkv's structlog events as dicts (``event``, ``log_level`` and the event's fields)."""
    import structlog

    with structlog.testing.capture_logs() as events:
        yield events


@contextlib.contextmanager
def embedded_servers(
    fast_size: str = "small",
    slow_size: str = "large",
    *,
    fast_window: int = 2048,
    slow_window: int = 16384,
    **server_kwargs: Any,
) -> Iterator[tuple[Any, Any]]:
    """Start two embedded vLLM-compatible servers on free loopback ports; stop them on exit.

    Yields ``(fast_server, slow_server)``; each has ``api_base``, ``model_id`` and ``backend()``, and keeps its
    last 10,000 requests in ``requests`` for the test to inspect (``request_log=0`` keeps none).
    """
    from agentkv.embedded.server import LocalServer

    server_kwargs.setdefault("request_log", 10_000)
    fast = LocalServer.from_size(fast_size, window=fast_window, **server_kwargs)
    slow = LocalServer.from_size(slow_size, window=slow_window, **server_kwargs)
    with fast, slow:
        yield fast, slow


class ScriptedReplies:
    """A litellm-compatible client for agent tests whose model has random weights.

    Each request goes out for real through litellm (token counts, windows, cache hits stay real);
    then the reply's message is replaced by the script's next step: a string is a final answer, a list
    of ``(name, json_arguments)`` pairs is a turn of tool calls. Warm-ahead requests (``max_tokens=1``)
    and requests past the end of the script pass through untouched.

        client = ScriptedReplies([[("search", '{"q": "disk"}')], "It was compaction."])
        Session(fast, slow, client=client).run("why?", tools={"search": search})
    """

    def __init__(self, script: list[Any]) -> None:
        from agentkv._env import import_litellm

        self.litellm = import_litellm()
        self.script = list(script)

    def _replace(self, response: Any, kwargs: dict[str, Any]) -> Any:
        if kwargs.get("max_tokens") == 1 or not self.script:
            return response
        step = self.script.pop(0)
        if isinstance(step, str):
            response.choices[0].message = self.litellm.Message(content=step)
        else:
            response.choices[0].message = self.litellm.Message(content="", tool_calls=[
                {"id": f"call_{len(self.script)}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(step)])
        return response

    def completion(self, **kwargs: Any) -> Any:
        return self._replace(self.litellm.completion(**kwargs), kwargs)

    async def acompletion(self, **kwargs: Any) -> Any:
        return self._replace(await self.litellm.acompletion(**kwargs), kwargs)


@contextlib.contextmanager
def redis_server(port: int | None = None, *, binary: str = "redis-server", ready_s: float = 10.0) -> Iterator[str]:
    """A throwaway ``redis-server`` on 127.0.0.1 (no persistence) for the length of a ``with``; yields its URL.

        with redis_server() as url:
            Session(fast, slow, state=RedisStore.from_url(url))

    Raises ``RuntimeError`` when the binary is missing or the server does not answer in ``ready_s``.
    """
    import shutil
    import socket
    import subprocess

    if shutil.which(binary) is None:
        raise RuntimeError(f"{binary} is not installed (Debian: apt-get install redis-server)")
    port = port or _free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{binary} did not start on port {port}") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ScriptedTransport:
    """An httpx transport (sync and async) for agents on OpenAI-SDK clients whose model has random weights.

    Every request goes out for real through ``inner`` (token counts, windows, cache hits stay real);
    then the JSON answer of a chat completion has its message replaced by the script's next step, as
    :class:`ScriptedReplies` does: a string is a final answer, a list of ``(name, json_arguments)``
    pairs a turn of tool calls. Streams, one-token warms and requests past the script pass untouched.

        transport = AgentKVTransport(session, inner=ScriptedTransport([[("search", '{"q": "disk"}')], "Done."]))
    """

    def __init__(self, script: list[Any], inner: Any = None, async_inner: Any = None) -> None:
        import httpx

        self.script = list(script)
        self._inner = inner or httpx.HTTPTransport()
        self._async_inner = async_inner or httpx.AsyncHTTPTransport()

    def handle_request(self, request: Any) -> Any:
        return self._scripted(request, self._inner.handle_request(request), lambda r: r.read())

    async def handle_async_request(self, request: Any) -> Any:
        response = await self._async_inner.handle_async_request(request)
        if self._scriptable(request, response):
            await response.aread()
        return self._scripted(request, response, lambda r: None)

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._async_inner.aclose()

    def _scriptable(self, request: Any, response: Any) -> bool:
        import json

        if not self.script or response.status_code != 200 or not request.url.path.endswith("/chat/completions"):
            return False
        body = json.loads(request.content or b"{}")
        return not body.get("stream") and body.get("max_tokens") != 1

    def _scripted(self, request: Any, response: Any, read: Callable[[Any], Any]) -> Any:
        from agentkv.integrations.openai import json_response

        if not self._scriptable(request, response):
            return response
        read(response)
        answer = response.json()
        answer["choices"][0]["message"] = _scripted_message(self.script.pop(0), len(self.script))
        answer["choices"][0]["finish_reason"] = "tool_calls" if answer["choices"][0]["message"].get("tool_calls") \
            else "stop"
        return json_response(200, answer, response.extensions)


def _scripted_message(step: Any, left: int) -> dict[str, Any]:
    if isinstance(step, str):
        return {"role": "assistant", "content": step}
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{left}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(step)]}
