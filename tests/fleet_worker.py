"""One orchestrator replica for tests/test_state_fleet.py: runs the turns it is told, on a shared RedisStore.

Commands arrive as JSON lines on stdin; each answer is one stdout line starting with ``RESULT ``.
Completions are answered here, except warms (``max_tokens=1``), which go to the test's HTTP model
server so that the fleet's warms are observed in one place: through the client for a litellm warm, and
through the HTTP seam for the raw POST warms that self-hosted backends get.
"""

import json
import sys
import time

import httpx

from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.state import RedisStore
from agentkv.testing import FakeHttp, models_answer

FAST, SLOW = "http://127.0.0.1:9301/v1", "http://127.0.0.1:9302/v1"
FILLER = "check the disk latency graphs and the queue depth "  # x130: ~1,300 tokens, past 0.6 x 2048
POLICY = WarmAheadPolicy(cooldown_s=300, timeout_s=2.0)


def models(method, url, body):
    return models_answer("fast-m", 2048) if url.startswith(FAST) else models_answer("slow-m", 16384)


class Client:
    """Answers requests itself; warms are POSTed to the model server; fast overflows above ``fast_limit``."""

    def __init__(self, server):
        self.server, self.fast_limit = server, None

    def completion(self, **kwargs):
        if kwargs.get("max_tokens") == 1:
            httpx.post(self.server, json={"messages": kwargs["messages"], "max_tokens": 1}, timeout=30).raise_for_status()
        elif self.fast_limit and kwargs["model"].endswith("fast-m"):
            raise BadRequestError(f"This model's maximum context length is {self.fast_limit} tokens. However, you "
                                  "requested 1408 tokens (1400 in the messages, 8 in the completion).")
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


def seam(server):
    """The Session's HTTP seam: /v1/models answered here, a warm's raw POST forwarded to the model server."""
    def handle(method, url, body):
        if method == "POST" and url.endswith("/chat/completions"):
            httpx.post(server, json={"messages": body["messages"], "max_tokens": 1}, timeout=30).raise_for_status()
            return {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        return models(method, url, body)

    return FakeHttp(handle)


class BadRequestError(Exception):
    status_code = 400


class Replica:
    def __init__(self, url, namespace, server):
        self.store = RedisStore.from_url(url, namespace=namespace, timeout_s=2.0)
        self.discovery = WindowDiscovery(http=FakeHttp(models), state=self.store)
        self.client = Client(server)
        self.http = seam(server)
        self.sessions = {}

    def session(self, tenant, sid):
        if (tenant, sid) not in self.sessions:
            self.sessions[tenant, sid] = Session(
                Backend("hosted_vllm/fast-m", api_base=FAST, name="fast"),
                Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow"), tenant=tenant, session_id=sid,
                state=self.store, discovery=self.discovery, client=self.client, http=self.http,
                count_with_server=False, warm_ahead=POLICY)
        return self.sessions[tenant, sid]

    def turn(self, tenant, sid, k, repeats=130):
        s = self.session(tenant, sid)
        messages = [{"role": "system", "content": f"session {tenant}/{sid}"}, {"role": "user", "content": FILLER * repeats},
                    {"role": "user", "content": f"turn {k}"}]
        for _ in range(500):  # a saturated (or, on a stalled machine, unguarded) warm is tried again
            s.completion(messages=messages, max_tokens=8)
            if s.ledger[-1].warm not in ("saturated", "state_unavailable"):
                return s.ledger[-1].warm
            time.sleep(0.01)
        return s.ledger[-1].warm

    def run(self, command):
        op = command["op"]
        if op == "turns":
            outcomes = [self.turn(*item) for item in command["items"]]
            saturated = sum(s.stats()["warm_skipped_saturated"] for s in self.sessions.values())
            drained = all(s.drain_warms(10) for s in self.sessions.values())
            return {"outcomes": outcomes, "saturated": saturated, "drained": drained}
        if op == "overflow":
            self.client.fast_limit = 1200
        if op in ("overflow", "probe", "hang"):
            # after the correction to 1,200, a warm needs ~720 to ~940 tokens: the hang's request is smaller
            self.turn("probe", f"{op}-{command['worker']}", 0, 80 if op == "hang" else 130)
            s = self.sessions["probe", f"{op}-{command['worker']}"]
            return {"role": s.last_route.role, "window": s._parts.discovery.window(s.fast, model_known=False).window,
                    "source": s._parts.discovery.window(s.fast, model_known=False).source}
        raise ValueError(op)


def main():
    url, namespace, server = sys.argv[1:4]
    replica = Replica(url, namespace, server)
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print("RESULT " + json.dumps(replica.run(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
