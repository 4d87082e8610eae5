"""`agentkv gateway` as the command line runs it, several processes sharing a real redis-server: one warm per
conversation across them, and ``--workers 2`` serving one port as one gateway (metrics summed over workers)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, multiprocess

from gateway_helpers import TOOLS8, conversation, metric, wait_for, warms


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CliGateway:
    """`agentkv gateway ...` in a subprocess, ready once GET /health answers 200; terminated on exit."""

    def __init__(self, fresh, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "agentkv.cli", "gateway", "--fast", fresh["fast"].api_base,
                "--fast-model", fresh["fast"].model_id, "--slow", fresh["slow"].api_base,
                "--slow-model", fresh["slow"].model_id, "--port", str(self.port), *extra]
        self.log = tmp_path / f"gateway-{self.port}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def __enter__(self) -> CliGateway:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                pytest.fail(f"the gateway did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def chat(self, key: str, **body: object) -> httpx.Response:
        """One request on a connection of its own (so a multi-worker gateway may hand it to either worker)."""
        with httpx.Client(timeout=60) as http:
            return http.post(self.root + "/v1/chat/completions", json={"model": "agentkv", **body},
                             headers={"authorization": f"Bearer {key}"})


@pytest.fixture
def tenant_keys(tmp_path):
    """A keys file with one key for a tenant of this test alone (the redis-server outlives the test)."""
    key, tenant = f"sk-{uuid.uuid4()}", f"fleet-{uuid.uuid4()}"
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({key: {"tenant": tenant}}))
    return key, str(path)


def run_alternating(gateways, key, fresh):
    """Send the scripted conversation's turns to the gateways in turn until one goes to slow."""
    fired = 0
    for turn, messages in enumerate(conversation()):
        answer = gateways[turn % len(gateways)].chat(key, messages=messages, tools=TOOLS8, max_tokens=8)
        assert answer.status_code == 200, answer.text
        if answer.headers["x-agentkv-backend"] == "slow":
            return answer, fired
        fired = sum(metric(g.root, "agentkv_warms_total", outcome="fire") for g in gateways)
        wait_for(lambda: len(warms(fresh["slow"])) == fired, "the warm to reach slow")  # noqa: B023
    raise AssertionError("the conversation never left fast")


def test_two_gateway_processes_sharing_redis_warm_a_conversation_once(fresh, tmp_path, redis_url, tenant_keys):
    """Turns alternating between two gateway processes on one Redis: one warm, then the escalation (cached)."""
    key, keys = tenant_keys
    with CliGateway(fresh, tmp_path, "--api-keys", keys, "--redis-url", redis_url) as a, \
            CliGateway(fresh, tmp_path, "--api-keys", keys, "--redis-url", redis_url) as b:
        answer, fired = run_alternating([a, b], key, fresh)
        cooled = sum(metric(g.root, "agentkv_warms_total", outcome="cooldown") for g in (a, b))
    assert fired == 1 and len(warms(fresh["slow"])) == 1 and cooled >= 1
    assert answer.headers["x-agentkv-route"] == "proactive" and answer.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"] > 0


def test_two_gateway_processes_without_redis_each_warm(fresh, tmp_path, tenant_keys):
    """The control: without shared state the same alternating conversation is warmed by both processes."""
    key, keys = tenant_keys
    with CliGateway(fresh, tmp_path, "--api-keys", keys) as a, CliGateway(fresh, tmp_path, "--api-keys", keys) as b:
        _, fired = run_alternating([a, b], key, fresh)
    assert fired == 2 and len(warms(fresh["slow"])) == 2


def per_worker_requests(directory):
    """``agentkv_requests_total`` of each worker, read from its own prometheus_client multiprocess files."""
    counts = {}
    for path in Path(directory).glob("counter_*.db"):
        alone = Path(directory) / f"one-{path.stem}"
        alone.mkdir(exist_ok=True)
        shutil.copy(path, alone / path.name)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(alone))
        value = registry.get_sample_value("agentkv_requests_total", {"backend": "fast", "route": "fits"})
        counts[path.stem] = value or 0.0
    return counts


def test_two_workers_serve_one_port_as_one_gateway(fresh, tmp_path, redis_url, tenant_keys):
    """--workers 2: both processes answer on the one port, /metrics sums them, and a conversation warms once."""
    key, keys = tenant_keys
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    with CliGateway(fresh, tmp_path, "--api-keys", keys, "--redis-url", redis_url, "--workers", "2",
                    env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as gateway:
        sent = 0
        while sum(1 for n in per_worker_requests(metrics_dir).values() if n) < 2:
            assert sent < 300, "one worker answered every request"
            body = {"messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 2}
            assert gateway.chat(key, **body).status_code == 200
            sent += 1
        total = metric(gateway.root, "agentkv_requests_total", backend="fast", route="fits")
        answer, fired = run_alternating([gateway], key, fresh)
    assert total == sent and fired == 1 and len(warms(fresh["slow"])) == 1
    assert answer.headers["x-agentkv-backend"] == "slow"


def test_two_gateways_on_one_redis_keep_a_conversation_on_one_replica_and_survive_its_death(fresh, tmp_path, redis_url,
                                                                                            tenant_keys):
    """``--slow A,B,C``: two gateway processes on one Redis send a conversation's warm and escalation to one replica
    with one routing key (never the conversation's id); that replica killed, the conversation's turns are still
    answered, by its next replica, warmed again before the escalation."""
    from agentkv.embedded.server import LocalServer

    pool = [LocalServer.from_size("tiny", window=16384, model_id=fresh["slow"].model_id, seed=1,
                                  request_log=10_000).start() for _ in range(3)]
    slow = ",".join(server.api_base for server in pool)
    key, keys = tenant_keys
    try:
        with CliGateway(fresh, tmp_path, "--api-keys", keys, "--redis-url", redis_url, "--slow", slow) as a, \
                CliGateway(fresh, tmp_path, "--api-keys", keys, "--redis-url", redis_url, "--slow", slow) as b:
            turns, sent = conversation(), 0
            for messages in turns:  # up to the first warm
                answer = (a, b)[sent % 2].chat(key, messages=messages, tools=TOOLS8, max_tokens=8)
                sent += 1
                assert answer.status_code == 200 and answer.headers["x-agentkv-backend"] == "fast"
                if sum(metric(g.root, "agentkv_warms_total", outcome="fire") for g in (a, b)):
                    break
            wait_for(lambda: any(warms(s) for s in pool), "the warm to reach a replica")
            home = next(s for s in pool if warms(s))
            keys_seen = {r.headers.get("x-session-id") for r in home.requests if r.path == "/v1/chat/completions"}
            assert len(keys_seen) == 1 and len(next(iter(keys_seen))) == 32
            home.stop()
            for messages in turns:
                answer = (a, b)[sent % 2].chat(key, messages=messages, tools=TOOLS8, max_tokens=8)
                sent += 1
                assert answer.status_code == 200, answer.text
                if answer.headers["x-agentkv-backend"] == "slow":
                    break
            others = [s for s in pool if s is not home]
            assert sum(len(warms(s)) for s in others) == 1  # warmed again, once, on the next replica
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert {r.headers.get("x-session-id") for s in others for r in s.requests
                    if r.path == "/v1/chat/completions"} == keys_seen
    finally:
        for server in pool:
            server.stop()

