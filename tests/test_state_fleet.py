"""Four replicas, one RedisStore: one warm per session fleet-wide, a fleet-wide in-flight bound, shared corrections,
and a slot that comes back after its holder is SIGKILLed."""

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import agentkv._support.env as _env
from agentkv.state import RedisStore, WarmClaim
from agentkv.telemetry import tenant_digest

WORKER = Path(__file__).with_name("fleet_worker.py")
WORKERS, CONVERSATIONS, LEASE_S = 4, 200, 3.0  # lease = the workers' warm timeout (2 s) + 1 s


class ModelServer:
    """The slow model as the fleet sees it: counts every warm per session and the peak of warms in flight."""

    def __init__(self):
        self.warms, self.in_flight, self.peak = collections.Counter(), 0, 0
        self.lock, self.release_hung, self.hung = threading.Lock(), threading.Event(), threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.serve(body["messages"][0]["content"])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/chat/completions"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def serve(self, marker):
        with self.lock:
            self.warms[marker] += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        if "hang" in marker:
            self.hung.set()
            self.release_hung.wait(30)
        else:
            time.sleep(0.05)
        with self.lock:
            self.in_flight -= 1

    def close(self):
        self.release_hung.set()
        self.httpd.shutdown()


class Fleet:
    """Worker processes driven over stdin/stdout lines."""

    def __init__(self, redis_url, namespace, server_url):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")])}
        self.procs = [subprocess.Popen([sys.executable, str(WORKER), redis_url, namespace, server_url], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(WORKERS)]
        for i in range(WORKERS):
            assert self.answer(i) == {"ready": True}

    def send(self, i, command):
        self.procs[i].stdin.write(json.dumps(command) + "\n")
        self.procs[i].stdin.flush()

    def answer(self, i):
        for line in self.procs[i].stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"worker {i} exited with {self.procs[i].wait()}")

    def all(self, commands):
        for i, command in enumerate(commands):
            self.send(i, command)
        return [self.answer(i) for i in range(len(commands))]

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def fleet(redis_url):
    server, namespace = ModelServer(), uuid.uuid4().hex
    fleet = Fleet(redis_url, namespace, server.url)
    yield fleet, server, RedisStore.from_url(redis_url, namespace=namespace, timeout_s=2.0)
    fleet.close()
    server.close()


def plan():
    """Conversation i's first turn runs on worker i % 4, its second on the next worker: 50 home sessions each."""
    items = [[] for _ in range(WORKERS)]
    for turn in (0, 1):
        for i in range(CONVERSATIONS):
            items[(i + turn) % WORKERS].append([f"tenant-{i % 2}", f"conv-{i}", turn])
    return [{"op": "turns", "items": batch} for batch in items]


def test_four_replicas_share_the_cooldowns_the_bound_and_corrections_and_survive_a_sigkill(fleet):
    """200 sessions over 4 processes: one warm each, <= 4 in flight at the server, maps bounded, a correction
    learned by one replica used by the others, and a SIGKILLed holder's slot back once its lease expires."""
    workers, server, store = fleet
    results = workers.all(plan())
    assert all(r["drained"] for r in results)
    assert len(server.warms) == CONVERSATIONS and set(server.warms.values()) == {1}
    assert sum(o == "fire" for r in results for o in r["outcomes"]) == CONVERSATIONS
    assert 1 <= server.peak <= 4 and sum(r["saturated"] for r in results) > 0  # the bound was reached, never passed
    # each tenant's cooldown map, under the key its Sessions claim with: the tenant's digest (keyed by the secret)
    tenants = [tenant_digest(f"tenant-{t}", _env.cache_salt_secret()) for t in (0, 1)]
    assert [store.client.zcard(store.keys.cooldowns(t)) for t in tenants] == [100, 100]

    learned = workers.all([{"op": "overflow", "worker": 0}])[0]
    assert (learned["window"], learned["source"]) == (1200, "corrected")
    for i in (1, 2, 3):
        workers.send(i, {"op": "probe", "worker": i})
        assert workers.answer(i) == {"role": "slow", "window": 1200, "source": "corrected"}

    workers.send(3, {"op": "hang", "worker": 3})
    workers.answer(3)
    assert server.hung.wait(10)
    os.kill(workers.procs[3].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert store.claim(WarmClaim("probe-check", "s0", 300, 256, 1, 30))[0] == "saturated"  # the dead one's lease
    n = 0
    while True:
        n += 1
        outcome, _ = store.claim(WarmClaim("probe-check", f"s{n}", 300, 256, 1, 30))
        if outcome == "fire":
            break
        assert time.monotonic() - killed_at < LEASE_S + 60, "the dead replica's slot did not come back"  # a bounded wait
        time.sleep(0.05)
    assert store.client.zcard(store.keys.leases()) == 1  # only the one just granted
