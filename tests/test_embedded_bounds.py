"""What a client can make the embedded server hold is bounded: no request log by default, body size, slow clients,
JSON depth, and the hermes tool-call parser's time on model output."""

from __future__ import annotations

import json
import socket
import threading

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.engine.models import build_model  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402
from agentkv.embedded.server.bounds import RequestLog, RequestLogDisabled, declared_too_large  # noqa: E402
from agentkv.embedded.server.tools import hermes_blocks, parse_hermes  # noqa: E402

LIMIT = 4096
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def server():
    engine = LocalEngine(build_model("tiny", seed=0), model_id="bounded", max_model_len=512)
    with LocalServer(engine, max_body_bytes=LIMIT, client_timeout_s=0.5) as running:
        yield running


def raw_exchange(server, data: bytes, *, wait_s: float = 10.0) -> bytes | None:
    """Send ``data`` on a fresh connection and read until the server closes it: what it sent, or None if the
    connection was still open after ``wait_s``."""
    with socket.create_connection((server.host, server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return None
        except ConnectionResetError:
            pass
    return received


# --- the request log --------------------------------------------------------------------------------------------


def test_a_server_keeps_no_request_bodies_by_default(server):
    """Without request_log nothing is kept, and reading the log says how to turn it on (not an empty list)."""
    httpx.post(server.api_base + "/chat/completions", json=CHAT, timeout=30)
    assert server._log.capacity == 0 and len(server._log._entries) == 0
    with pytest.raises(RequestLogDisabled, match="request_log=N"):
        _ = server.requests


def test_the_opt_in_request_log_keeps_only_the_last_n():
    """request_log=N keeps the newest N requests, oldest first, and clear() empties it."""
    log = RequestLog(2)
    for i in range(5):
        log.record("POST", "/tokenize", {"prompt": str(i)})
    assert [r.body["prompt"] for r in log.entries()] == ["3", "4"]
    log.clear()
    assert log.entries() == []
    with pytest.raises(ValueError):
        RequestLog(-1)


# --- body size ---------------------------------------------------------------------------------------------------


def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(server):
    """A Content-Length over the limit is answered 413 at once: the client has sent no byte of the body."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10 ** 9}\r\n\r\n").encode()
    answer = raw_exchange(server, head) or b""
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert (error["type"], error["code"]) == ("Request Entity Too Large", 413) and str(LIMIT) in error["message"]


def test_a_streamed_body_is_cut_off_once_it_passes_the_limit(server):
    """A chunked body without Content-Length is refused with 413 once more than the limit has arrived."""
    def chunks():
        for _ in range(64):
            yield b" " * 1024

    response = httpx.post(server.api_base + "/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_a_body_within_the_limit_is_served(server):
    """The limit refuses nothing below it."""
    assert declared_too_large(str(LIMIT), LIMIT) is False and declared_too_large(str(LIMIT + 1), LIMIT) is True
    response = httpx.post(server.api_base + "/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200


# --- slow clients ------------------------------------------------------------------------------------------------


def test_a_client_withholding_its_headers_is_disconnected(server):
    """Half a request's headers, then nothing: the server closes the connection after its client timeout."""
    answer = raw_exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert answer == b""  # closed by the server without an answer (None: still open after 10 s)


def test_a_client_dripping_its_headers_is_disconnected(server):
    """Bytes that keep arriving do not extend the deadline: a slowloris is still dropped."""
    with socket.create_connection((server.host, server.port)) as sock:
        sock.settimeout(0.05)  # the pause between drips
        for _ in range(200):  # up to 10 s of one byte every 0.05 s: twenty times the 0.5 s timeout
            try:
                sock.sendall(b"X")
                if sock.recv(1) == b"":
                    break  # closed by the server
            except TimeoutError:
                continue  # still open: drip on
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            pytest.fail("a client dripping its headers kept its connection")


def test_a_client_withholding_its_body_gets_408(server):
    """Headers promising 100 bytes, then 10: the answer is 408 once the client timeout has passed."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"messages\"")
    answer = raw_exchange(server, head) or b""
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "Request Timeout"


def test_a_keep_alive_connection_serves_more_than_one_request(server):
    """The header deadline re-arms after an answer without cutting a connection that keeps sending requests."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert [client.get("/health").status_code for _ in range(3)] == [200, 200, 200]


# --- JSON depth --------------------------------------------------------------------------------------------------


def test_a_body_nested_too_deep_is_a_400():
    """100k nested arrays (a RecursionError in the parser, not a ValueError) are FastAPI's 400, as vLLM's."""
    engine = LocalEngine(build_model("tiny", seed=0), model_id="deep", max_model_len=512)
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with LocalServer(engine) as running:  # the default 32 MiB limit admits this 200 kB body
        response = httpx.post(running.api_base + "/chat/completions", content=body, timeout=30,
                              headers={"content-type": "application/json"})
    assert (response.status_code, response.json()) == (400, {"detail": "There was an error parsing the body"})


# --- the hermes tool-call parser ----------------------------------------------------------------------------------


def test_hermes_parsing_is_linear_in_the_model_output():
    """An open <tool_call> followed by a million spaces parses at once (the old regex took 26 s for 4,000)."""
    done = threading.Event()
    result: list = []

    def parse() -> None:
        result.append(parse_hermes("<tool_call>" + " " * 1_000_000))
        done.set()

    threading.Thread(target=parse, daemon=True).start()
    assert done.wait(30), "parse_hermes did not finish: it is not linear"
    assert result == [("<tool_call>" + " " * 1_000_000, [])]


def test_hermes_blocks_are_vllms_closed_blocks_and_a_final_open_one():
    """Blocks between the tags, then one left open to the end, as vLLM's hermes regex finds them."""
    text = 'Sure. <tool_call>{"name": "a", "arguments": {}}</tool_call> x <tool_call>{"name": "b"}'
    assert list(hermes_blocks(text)) == ['{"name": "a", "arguments": {}}', '{"name": "b"}']
    content, calls = parse_hermes(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["a", "b"]
