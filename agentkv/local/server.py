"""The local server: a :class:`~agentkv.local.engine.LocalEngine` behind vLLM's OpenAI-compatible HTTP API.

Standard library only (``http.server``), bound to 127.0.0.1. It runs in a daemon thread of the caller's process
(tests, the demo) or in the foreground (``agentkv serve``). The served model id and window can be changed while it
runs, as when a swap slot loads another model, and every request is logged for tests to inspect.

Usage::

    with LocalServer.from_size("small", window=2048) as server:
        litellm.completion(model="hosted_vllm/agentkv-small", api_base=server.api_base, messages=...)
        server.max_model_len = 4096
        server.requests        # [LoggedRequest(method, path, body), ...]
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from agentkv.events import emit
from agentkv.local import routes
from agentkv.local.engine import LocalEngine

_RUNNING: dict[str, LocalEngine] = {}
"""Engines served by running LocalServers of this process, by base URL."""


@atexit.register
def _quiesce_at_exit(timeout_s: float = 60.0) -> None:
    """Let in-flight requests (a warm-ahead, say) finish before the interpreter tears torch down."""
    for engine in list(_RUNNING.values()):
        engine.quiesce(timeout_s)


def engine_at(api_base: str | None) -> LocalEngine | None:
    """The in-process engine serving ``api_base`` (with or without ``/v1``), or None.

    This is how a Session finds local engines to hand KV between at escalation.
    """
    if not api_base:
        return None
    base = api_base.rstrip("/")
    return _RUNNING.get(base[: -len("/v1")] if base.endswith("/v1") else base)


class LoggedRequest(NamedTuple):
    """One request as the server received it; ``body`` is the parsed JSON (None when absent or malformed)."""

    method: str
    path: str
    body: Any


class _HTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that can close its open keep-alive connections on shutdown."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], served: LocalServer) -> None:
        super().__init__(address, _Handler)
        self.served = served
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Shut down every open client socket so handler threads return."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    """Reads a request, asks :func:`routes.handle`, writes the reply (SSE replies chunked)."""

    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: requests are in :attr:`LocalServer.requests` and completions are events."""

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        reply = routes.handle(self.server.served, method, urlsplit(self.path).path, raw)
        if reply.events is not None:
            self._send_events(reply)
        else:
            self._send_whole(reply)

    def _send_whole(self, reply: routes.Reply) -> None:
        data = reply.payload()
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_events(self, reply: routes.Reply) -> None:
        assert reply.events is not None
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in reply.events:
                self.wfile.write(b"%X\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            emit("local.stream.disconnected")
        except Exception:  # headers are sent: the only way left to report failure is to drop the connection
            emit("local.stream.failed", level="exception")
            self.close_connection = True
        finally:
            reply.events.close()


class LocalServer:
    """vLLM's OpenAI-compatible API for one engine, on 127.0.0.1."""

    def __init__(self, engine: LocalEngine, host: str = "127.0.0.1", port: int = 0, *,
                 root: str | None = None, kv_events_config: Any = None) -> None:
        self.engine = engine
        self.kv_events = engine.prefix_cache.publish_events(kv_events_config)  # vLLM's --kv-events-config
        self.created = int(time.time())
        self.root = root or engine.model_id
        self._requests: list[LoggedRequest] = []
        self._requests_lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), self)
        self._thread: threading.Thread | None = None

    @classmethod
    def from_size(cls, size: str = "small", *, window: int | None = None, model_id: str | None = None,
                  port: int = 0, **engine_kwargs: Any) -> LocalServer:
        """A server over ``LocalEngine.from_size(size)``, served as ``agentkv-{size}`` unless named."""
        engine = LocalEngine.from_size(size, model_id=model_id, max_model_len=window, **engine_kwargs)
        return cls(engine, port=port)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, window: int | None = None, model_id: str | None = None,
                        port: int = 0, **engine_kwargs: Any) -> LocalServer:
        """A server over a checkpoint folder; the model id defaults to the folder's name."""
        engine = LocalEngine.from_pretrained(path, model_id=model_id, max_model_len=window, **engine_kwargs)
        return cls(engine, port=port, root=str(path))

    # --- where it listens ------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: where ``/tokenize``, ``/metrics`` and ``/health`` live."""
        return f"http://{self.host}:{self.port}"

    @property
    def api_base(self) -> str:
        """``base_url + "/v1"``: what litellm's ``api_base`` should be."""
        return f"{self.base_url}/v1"

    # --- what it serves, changeable at runtime ---------------------------------------------------

    @property
    def model_id(self) -> str:
        """The served model id (``hosted_vllm/<model_id>`` through litellm)."""
        return self.engine.model_id

    @model_id.setter
    def model_id(self, value: str) -> None:
        self.engine.model_id = value

    @property
    def max_model_len(self) -> int:
        """The window requests are validated against and ``/v1/models`` reports."""
        return self.engine.max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self.set_max_model_len(value)

    def set_max_model_len(self, value: int) -> None:
        """Serve with another window from the next request on."""
        if value < 1:
            raise ValueError("max_model_len must be positive")
        self.engine.max_model_len = int(value)
        emit("local.server.window_changed", model_id=self.model_id, max_model_len=int(value))

    def backend(self, *, declare_window: bool = False, **overrides: Any) -> Any:
        """An :class:`agentkv.Backend` addressing this server, with the engine's tokenizer and template.

        The window is left to discovery (``/v1/models``) unless ``declare_window``; ``overrides`` are passed on.
        """
        from agentkv.backends import Backend
        from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE

        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            tokenizer, template = "cl100k_base", getattr(self.engine.codec, "template", None)
        else:
            template = getattr(tokenizer, "chat_template", None) or CHATML_TOOLS_TEMPLATE
        fields: dict[str, Any] = {"model": f"hosted_vllm/{self.model_id}", "api_base": self.api_base,
                                  "name": self.model_id, "tokenizer": tokenizer, "chat_template": template}
        if declare_window:
            fields["window"] = self.max_model_len
        return Backend(**{**fields, **overrides})

    # --- request log -----------------------------------------------------------------------------

    def record(self, method: str, path: str, body: Any) -> None:
        """Append one request to :attr:`requests` (called by the routes)."""
        with self._requests_lock:
            self._requests.append(LoggedRequest(method, path, body))

    @property
    def requests(self) -> list[LoggedRequest]:
        """A copy of every request received since the last :meth:`clear_requests`."""
        with self._requests_lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        """Forget the logged requests."""
        with self._requests_lock:
            self._requests.clear()

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LocalServer:
        """Serve in a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                            name=f"agentkv-serve-{self.port}", daemon=True)
            self._thread.start()
            _RUNNING[self.base_url] = self.engine
            emit("local.server.started", model_id=self.model_id, base_url=self.base_url,
                 max_model_len=self.max_model_len)
        return self

    def stop(self) -> None:
        """Stop accepting requests, close open connections, join the serving thread, release the port."""
        _RUNNING.pop(self.base_url, None)
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.close_connections()
        self._httpd.server_close()
        self.kv_events.shutdown()
        emit("local.server.stopped", model_id=self.model_id, port=self.port)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
