"""agentkv.vllm_launch without vLLM: the one wait-until-ready loop that the vLLM server and the router both use."""

import http.server
import subprocess
import sys
import threading

import pytest

from agentkv.vllm_launch.server import free_port, wait_until_ready


class _Clock:
    """A monotonic clock that moves only when the loop sleeps."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def answering():
    """An HTTP server on 127.0.0.1 answering 200 on /health and 503 elsewhere: its root."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_ready_once_every_check_answers_200(sleeper, answering):
    """A live process whose every check URL answers 200 is ready at once (None, no sleep)."""
    clock = _Clock()
    assert wait_until_ready(sleeper, [(answering + "/health", 2.0)], timeout_s=10, interval_s=0.5, clock=clock,
                            sleep=clock.sleep) is None
    assert clock.sleeps == []


def test_not_ready_while_one_check_fails_until_the_timeout(sleeper, answering):
    """One check that does not answer 200 keeps the process waiting, every interval, until the timeout."""
    clock = _Clock()
    checks = [(answering + "/health", 2.0), (answering + "/v1/models", 2.0)]
    assert wait_until_ready(sleeper, checks, timeout_s=2, interval_s=0.5, clock=clock,
                            sleep=clock.sleep) == "not ready after 2 s"
    assert clock.sleeps == [0.5, 0.5, 0.5, 0.5]


def test_a_refused_connection_is_waited_on(sleeper):
    """Nothing listening yet (a booting server) is waiting, not an error."""
    clock = _Clock()
    url = f"http://127.0.0.1:{free_port()}/health"
    assert wait_until_ready(sleeper, [(url, 1.0)], timeout_s=1, interval_s=0.3, clock=clock,
                            sleep=clock.sleep) == "not ready after 1 s"
    assert len(clock.sleeps) == 4


def test_a_process_that_exits_is_reported_with_its_code():
    """A process that died while booting ends the wait with its exit code."""
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    clock = _Clock()
    assert wait_until_ready(process, [("http://127.0.0.1:9/health", 1.0)], timeout_s=10, interval_s=0.5,
                            clock=clock, sleep=clock.sleep) == "exited with 3"
