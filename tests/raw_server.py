"""A raw-socket HTTP server for the faults no framework produces on purpose (tests only).

Each connection gets one request read and one answer chosen by ``mode``; the server counts the chat
completions it was sent (``chats``) and the bytes of body it wrote (``sent``).

    "answer"        a chat completion (an SSE stream when the request asks for one), vLLM-shaped
    "close"         reads the request, closes without a byte
    "reset"         reads the request, closes with a TCP RST
    "partial"       headers and half of a JSON body, then closes
    "stream_cut"    SSE headers and one event, then closes (a stream broken after its first bytes)
    "stream_empty"  SSE headers, then closes before any event
    "503"           a vLLM-shaped 503
    "silent"        reads the request and answers nothing until the server is closed
    "drip"          ``head`` at once, then ``payload`` one byte every ``every`` seconds
    "raw"           ``payload`` (a whole HTTP response) at once
    "big"           a 200 JSON answer of ``size`` bytes, written as fast as the client reads
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

COMPLETION = {"id": "cmpl-1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                        "prompt_tokens_details": {"cached_tokens": 0}}}


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


FIRST_EVENT = _event({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": "o"}, "finish_reason": None}]})
LAST_EVENTS = (_event({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}]})
               + _event({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                         "usage": COMPLETION["usage"]})
               + b"data: [DONE]\n\n")
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"


def json_answer(status: int, body: object, reason: str = "OK") -> bytes:
    raw = json.dumps(body).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason.encode(), len(raw)) + raw)


class RawServer:
    """One listening socket on 127.0.0.1 serving ``mode`` (see the module docstring) until :meth:`close`."""

    def __init__(self, mode: str, *, payload: bytes = b"", head: bytes = b"", every: float = 0.05,
                 size: int = 0) -> None:
        self.mode, self.payload, self.head, self.every, self.size = mode, payload, head, every, size
        self.chats = 0
        self.sent = 0
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def __enter__(self) -> "RawServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> tuple[bytes, bytes] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            piece = conn.recv(65536)
            if not piece:
                return None
            data += piece
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            piece = conn.recv(65536)
            if not piece:
                break
            body += piece
        return head, body

    def _serve(self, conn: socket.socket) -> None:
        try:
            request = self._read(conn)
            if request is None:
                return
            head, body = request
            self.requests.append(head.split(b"\r\n", 1)[0])
            if b"/chat/completions" in head.split(b"\r\n", 1)[0]:
                self.chats += 1
            self._answer(conn, body)
        except OSError:
            pass
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, body: bytes) -> None:
        mode = self.mode
        if mode == "answer":
            streamed = json.loads(body or b"{}").get("stream")
            conn.sendall(SSE_HEAD + _chunked(FIRST_EVENT + LAST_EVENTS) + b"0\r\n\r\n" if streamed
                         else json_answer(200, COMPLETION))
        elif mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif mode == "partial":
            whole = json_answer(200, COMPLETION)
            conn.sendall(whole[:len(whole) - 40])
        elif mode == "stream_cut":
            conn.sendall(SSE_HEAD + _chunked(FIRST_EVENT))
            self.sent += len(FIRST_EVENT)
        elif mode == "stream_empty":
            conn.sendall(SSE_HEAD)
        elif mode == "503":
            conn.sendall(json_answer(503, {"error": {"message": "Service Unavailable", "type": "ServiceUnavailable",
                                                     "code": 503}}, "Service Unavailable"))
        elif mode == "silent":
            self._stop.wait(30)
        elif mode == "raw":
            conn.sendall(self.payload)
        elif mode == "drip":
            conn.sendall(self.head)
            for i in range(len(self.payload)):
                if self._stop.is_set():
                    return
                conn.sendall(self.payload[i:i + 1])
                self.sent += 1
                time.sleep(self.every)
        elif mode == "big":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n[" % self.size)
            left, block = self.size - 2, b" " * 65536
            while left > 0:
                n = min(left, len(block))
                conn.sendall(block[:n])
                self.sent += n
                left -= n
            conn.sendall(b"]")
        # "close": nothing


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
