"""The loopback HTTP server every provider fake runs on, and the fakes' own tokenizer.

A fake is a handler ``(Call) -> JsonReply`` served by :class:`FakeServer` on ``127.0.0.1`` (a free port), on a thread
of its own, stopped when its ``with`` block ends. Every call is recorded (method, path, query, headers, JSON body)
so that tests read what litellm really sent.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs, urlsplit

__all__ = ["Call", "FakeServer", "JsonReply", "fake_tokens"]

_TOKEN = re.compile(r"\w+|[^\w\s]")
_MAX_BODY = 64 * 1024 * 1024


def fake_tokens(text: str) -> list[str]:
    """The fakes' tokenizer: words and single punctuation marks (deliberately unlike cl100k, so that an estimate
    and the provider's count differ the way they do against a real provider)."""
    return _TOKEN.findall(text)


@dataclass(frozen=True)
class Call:
    """One request as the fake received it."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # lower-cased names
    body: Any  # the parsed JSON body (None when there was none)


@dataclass(frozen=True)
class JsonReply:
    """What the fake answers: a status and a JSON body (``headers`` added)."""

    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


class FakeServer:
    """Serves ``handler`` on 127.0.0.1 until the ``with`` block ends; ``calls`` lists every request received."""

    def __init__(self, handler: Callable[[Call], JsonReply], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.handler, self.clock = handler, clock
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no path)."""
        if self._httpd is None:
            raise RuntimeError("the fake is not running: use it in a with block")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "FakeServer":
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._httpd.daemon_threads = True
        httpd = self._httpd
        self._thread = threading.Thread(target=lambda: httpd.serve_forever(poll_interval=0.05),
                                        name="agentkv-provider-fake", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def record(self, call: Call) -> JsonReply:
        with self._lock:
            self.calls.append(call)
        return self.handler(call)


def _handler_class(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            return

        def _serve(self) -> None:
            length = min(int(self.headers.get("content-length") or 0), _MAX_BODY)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                self._send(JsonReply(400, {"error": {"message": "body is not JSON"}}))
                return
            parts = urlsplit(self.path)
            call = Call(self.command, parts.path, parse_qs(parts.query),
                        {k.lower(): v for k, v in self.headers.items()}, body)
            try:
                reply = server.record(call)
            except Exception as exc:  # a bug in a fake answers 500, never hangs the client
                reply = JsonReply(500, {"error": {"message": f"fake failed: {type(exc).__name__}: {exc}"}})
            self._send(reply)

        def _send(self, reply: JsonReply) -> None:
            data = json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = do_PATCH = _serve

    return Handler
