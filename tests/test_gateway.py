"""`agentkv gateway` with real clients (the OpenAI Python SDK, curl, httpx) against the embedded servers: routing
and route headers, one warm per conversation, tenants and salts, and the answers the gateway makes itself."""

from __future__ import annotations

import json
import socket
import subprocess
import uuid

import httpx
import openai
import pytest

from agentkv import derive_cache_salt
from agentkv.gateway import GatewayConfig, GatewayThread
from conftest import chat_requests
from gateway_helpers import (
    ACME, GLOBEX, SECRET, TOOLS8, aborted, config_fields, conversation, metric, wait_for, warms,
)


@pytest.fixture
def make_gateway(fresh, tmp_path):
    """Start gateways over the fresh servers (the test keys file unless overridden); all stopped after the test."""
    started = []

    def make(**overrides):
        gateway = GatewayThread(GatewayConfig(**config_fields(fresh, tmp_path, **overrides))).start()
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.stop()


@pytest.fixture
def gateway(make_gateway):
    return make_gateway()


def closed_port_url():
    """A base URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def post(gateway, path, body, key=ACME, **kwargs):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    kwargs.setdefault("timeout", 60)
    return httpx.post(gateway.base_url + path, json=body, headers={**headers, **kwargs.pop("headers", {})}, **kwargs)


def no_route_headers(response):
    return "x-agentkv-backend" not in response.headers and "x-agentkv-route" not in response.headers


# ----------------------------------------------------------------------------- the OpenAI Python SDK

def test_sync_sdk_conversation_warms_once_and_escalates_with_route_headers(gateway, fresh):
    """openai.OpenAI turn after turn: fast while it fits, one warm at 60%, then slow (proactive) with cached tokens."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    salt = derive_cache_salt(SECRET, "acme")
    for messages in conversation():
        raw = client.chat.completions.with_raw_response.create(model="anything", messages=messages, tools=TOOLS8,
                                                               max_tokens=8)
        answer = raw.parse()
        if raw.headers["x-agentkv-backend"] == "slow":
            break
        assert raw.headers["x-agentkv-route"] in ("fits", "clamped") and answer.model == fresh["fast"].model_id
        wait_for(lambda: len(warms(fresh["slow"])) == metric(gateway.root, "agentkv_warms_total", outcome="fire"),
                 "the warm to reach slow")
    assert raw.headers["x-agentkv-route"] == "proactive" and answer.model == fresh["slow"].model_id
    assert len(warms(fresh["slow"])) == 1 and answer.usage.prompt_tokens_details.cached_tokens > 0
    sent = chat_requests(fresh["fast"]) + chat_requests(fresh["slow"])
    assert sent and all(body["cache_salt"] == salt for body in sent)
    assert metric(gateway.root, "agentkv_requests_total", backend="slow", route="proactive") == 1


async def test_async_sdk_streams_and_escalates(gateway, fresh):
    """openai.AsyncOpenAI streaming through the gateway: chunks as the backend sent them, slow's once past fast."""
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    for messages in conversation():
        raw = await client.chat.completions.with_raw_response.create(
            model="agentkv", messages=messages, tools=TOOLS8, max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in raw.parse()]
        if raw.headers["x-agentkv-backend"] == "slow":
            break
        wait_for(lambda: len(warms(fresh["slow"])) == metric(gateway.root, "agentkv_warms_total", outcome="fire"),
                 "the warm to reach slow")
    assert raw.headers["x-agentkv-route"] == "proactive" and raw.headers["content-type"].startswith("text/event-stream")
    assert {c.model for c in chunks} == {fresh["slow"].model_id} and chunks[-1].usage.prompt_tokens > 1229
    assert len(warms(fresh["slow"])) == 1


def test_sync_sdk_stream_arrives_before_the_backend_has_finished(gateway, fresh):
    """The first chunk reaches the client while the backend is still generating: nothing is buffered whole."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{uuid.uuid4()}"}],
                                            max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.model == fresh["fast"].model_id and fresh["fast"].engine.stats().running == 1
    rest = list(stream)
    assert len(rest) > 100 and rest[-1].choices[0].finish_reason == "length"


def test_text_completions_are_routed_by_the_same_rules(gateway, fresh):
    """POST /v1/completions: a short prompt on fast, one past fast's window on slow (proactive), streams too."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    short = client.completions.with_raw_response.create(model="x", prompt=f"{uuid.uuid4()} hi", max_tokens=4)
    long = client.completions.with_raw_response.create(model="x", prompt=f"{uuid.uuid4()} " + "word " * 2500,
                                                       max_tokens=4)
    assert (short.headers["x-agentkv-backend"], short.headers["x-agentkv-route"]) == ("fast", "fits")
    assert (long.headers["x-agentkv-backend"], long.headers["x-agentkv-route"]) == ("slow", "proactive")
    assert short.parse().model == fresh["fast"].model_id and long.parse().model == fresh["slow"].model_id
    sent = [r.body for r in fresh["slow"].requests if r.path == "/v1/completions"]
    assert sent[-1]["cache_salt"] == derive_cache_salt(SECRET, "acme") and sent[-1]["model"] == fresh["slow"].model_id
    chunks = list(client.completions.create(model="x", prompt=f"{uuid.uuid4()} hi", max_tokens=4, stream=True))
    assert len(chunks) > 1 and {c.model for c in chunks} == {fresh["fast"].model_id}


def test_the_sdk_sees_a_401_as_an_authentication_error(gateway):
    """A client with an unknown key gets openai.AuthenticationError (401 in OpenAI's shape)."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="sk-nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401 and caught.value.body["type"] == "authentication_error"


# ----------------------------------------------------------------------------- curl

def curl(*args):
    done = subprocess.run(["curl", "-sS", "-D", "-", *args], capture_output=True, text=True, timeout=60, check=True)
    head, _, body = done.stdout.partition("\n\n")  # text mode reads "\r\n" as "\n"
    return head.lower(), body


def test_curl_json_and_streaming(gateway, fresh):
    """curl gets JSON with the route headers, and an SSE stream that ends with [DONE]."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 5}
    common = [gateway.base_url + "/chat/completions", "-H", f"Authorization: Bearer {ACME}",
              "-H", "content-type: application/json"]
    head, text = curl(*common, "-d", json.dumps(body))
    assert "x-agentkv-backend: fast" in head and "x-agentkv-route: fits" in head
    assert json.loads(text)["model"] == fresh["fast"].model_id
    head, text = curl("-N", *common, "-d", json.dumps({**body, "stream": True}))
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert "text/event-stream" in head and "x-agentkv-backend: fast" in head
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "chat.completion.chunk"


# ----------------------------------------------------------------------------- keys, tenants, identity

def test_missing_and_unknown_keys_get_401_and_reach_no_backend(gateway, fresh):
    """No key, an unknown key and a non-Bearer scheme are 401s in OpenAI's shape without route headers."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answers = [post(gateway, "/chat/completions", body, key=None), post(gateway, "/chat/completions", body, key="sk-x"),
               post(gateway, "/completions", {"model": "m", "prompt": "hi"}, key=None),
               httpx.get(gateway.base_url + "/models"),
               post(gateway, "/chat/completions", body, key=None, headers={"authorization": f"Basic {ACME}"})]
    assert [a.status_code for a in answers] == [401] * 5
    assert all(a.json()["error"]["type"] == "authentication_error" and no_route_headers(a) for a in answers)
    assert chat_requests(fresh["fast"]) == chat_requests(fresh["slow"]) == []
    assert httpx.get(gateway.root + "/health").status_code == httpx.get(gateway.root + "/metrics").status_code == 200


def test_tenants_get_their_own_salt_and_conversation(gateway, fresh):
    """The same opening from two tenants is two conversations, each salted HMAC(secret, tenant), never the key."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 3}
    post(gateway, "/chat/completions", body, key=ACME).raise_for_status()
    post(gateway, "/chat/completions", body, key=GLOBEX).raise_for_status()
    post(gateway, "/chat/completions", body, key=GLOBEX).raise_for_status()
    salts = [b["cache_salt"] for b in chat_requests(fresh["fast"])]
    assert salts == [derive_cache_salt(SECRET, "acme")] + [derive_cache_salt(SECRET, "globex")] * 2
    assert ACME not in salts and GLOBEX not in salts
    assert sorted(tenant for tenant, _ in gateway.app.state.ctx.sessions.keys()) == ["acme", "globex"]


def test_conversation_identity_is_header_then_user_then_opening(gateway):
    """x-session-id wins over `user`, which wins over the opening's fingerprint; later turns keep the fingerprint."""
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{uuid.uuid4()}"}]
    later = opening + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    for body, headers in [({"messages": opening}, {}), ({"messages": later}, {}),
                          ({"messages": later, "user": "u-1"}, {}), ({"messages": opening, "user": "u-1"}, {}),
                          ({"messages": later, "user": "u-1"}, {"x-session-id": "chat-9"})]:
        post(gateway, "/chat/completions", {"model": "m", "max_tokens": 2, **body}, headers=headers).raise_for_status()
    kinds = sorted(conversation[:2] for _, conversation in gateway.app.state.ctx.sessions.keys())
    assert kinds == ["f:", "h:", "u:"]
    assert metric(gateway.root, "agentkv_gateway_sessions") == 3


def test_an_anonymous_gateway_needs_no_key(make_gateway, fresh):
    """Without --api-keys every request is the anonymous tenant's, salted from the configured secret."""
    gateway = make_gateway(api_keys=None)
    body = {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 3}
    answer = post(gateway, "/chat/completions", body, key=None)
    assert answer.status_code == 200 and answer.headers["x-agentkv-backend"] == "fast"
    assert chat_requests(fresh["fast"])[-1]["cache_salt"] == derive_cache_salt(SECRET, "anonymous")


# ----------------------------------------------------------------------------- bad input and limits

def test_bodies_past_the_limit_get_413_and_reach_no_backend(make_gateway, fresh):
    """A body over the configured limit is a 413, declared (Content-Length) or streamed (chunked)."""
    gateway = make_gateway(max_body_bytes=2048)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    declared = post(gateway, "/chat/completions", big)
    chunked = httpx.post(gateway.base_url + "/chat/completions", content=iter([json.dumps(big).encode()]),
                         headers={"authorization": f"Bearer {ACME}", "content-type": "application/json"})
    assert declared.status_code == chunked.status_code == 413
    assert declared.json()["error"]["code"] == 413 and no_route_headers(declared) and no_route_headers(chunked)
    assert chat_requests(fresh["fast"]) == chat_requests(fresh["slow"]) == []
    assert metric(gateway.root, "agentkv_gateway_rejections_total", status="413") == 2


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"', b'{"model": "m", "messages": "hi"}',
                                 b'{"model": "m"}', b'{"model": "m", "messages": ["hi"]}',
                                 b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}'])
def test_bad_bodies_get_400_and_reach_no_backend(gateway, fresh, raw):
    """Not JSON, not an object, `messages` not an array of objects, a bad budget: 400 in OpenAI's shape."""
    answer = httpx.post(gateway.base_url + "/chat/completions", content=raw,
                        headers={"authorization": f"Bearer {ACME}", "content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    assert no_route_headers(answer) and chat_requests(fresh["fast"]) == chat_requests(fresh["slow"]) == []


def test_a_completion_without_a_prompt_is_a_400(gateway):
    """POST /v1/completions needs a string (or strings) prompt."""
    answer = post(gateway, "/completions", {"model": "m", "prompt": 3})
    assert answer.status_code == 400 and "prompt" in answer.json()["error"]["message"] and no_route_headers(answer)


def test_unknown_v1_paths_are_404_in_openai_shape(gateway):
    """A /v1 path the gateway does not serve is a 404 error object (after the key check)."""
    answer = httpx.get(gateway.base_url + "/embeddings", headers={"authorization": f"Bearer {ACME}"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == 404


# ----------------------------------------------------------------------------- backends failing

def test_a_fast_backend_down_fails_over_to_slow(make_gateway, fresh):
    """Fast unreachable: the request is answered by slow, with route `failover`, and counted."""
    gateway = make_gateway(fast_url=closed_port_url(), connect_timeout_s=2.0)
    answer = post(gateway, "/chat/completions",
                  {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["model"] == fresh["slow"].model_id
    assert (answer.headers["x-agentkv-backend"], answer.headers["x-agentkv-route"]) == ("slow", "failover")
    assert metric(gateway.root, "agentkv_failovers_total") == 1


def test_a_slow_backend_down_fails_over_to_fast_when_the_request_fits(make_gateway, fresh):
    """Slow unreachable: a request routed to slow goes to fast when its input leaves room there, route `failover`."""
    gateway = make_gateway(slow_url=closed_port_url(), connect_timeout_s=2.0)
    messages = next(m for i, m in enumerate(conversation()) if i == 7)  # ~1,900 tokens: slow by the output floor
    answer = post(gateway, "/chat/completions", {"model": "m", "messages": messages, "tools": TOOLS8, "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["model"] == fresh["fast"].model_id
    assert (answer.headers["x-agentkv-backend"], answer.headers["x-agentkv-route"]) == ("fast", "failover")


def test_both_backends_down_is_a_502_in_openai_shape(make_gateway):
    """With nothing reachable the gateway answers 502 itself (no route headers)."""
    gateway = make_gateway(fast_url=closed_port_url(), slow_url=closed_port_url(), connect_timeout_s=2.0)
    answer = post(gateway, "/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_error" and no_route_headers(answer)


def test_a_failure_inside_the_gateway_is_a_500_in_openai_shape_and_the_next_request_is_served(gateway, monkeypatch):
    """An unexpected error while relaying (here: the Session fails) answers 500 in OpenAI's shape, naming only the
    error's type, and the connection goes on serving."""
    from agentkv import Session

    def broken(self, body):
        raise RuntimeError("secret prompt text")

    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {ACME}"}) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        with monkeypatch.context() as patch:
            patch.setattr(Session, "aprepare", broken)
            patch.setattr(Session, "presend", lambda self, body: None)
            failed = http.post(gateway.base_url + "/chat/completions", json=body)
        served = http.post(gateway.base_url + "/chat/completions", json=body)
    assert failed.status_code == 500 and no_route_headers(failed)
    assert failed.json()["error"]["type"] == "api_error" and "RuntimeError" in failed.json()["error"]["message"]
    assert "secret" not in failed.text
    assert served.status_code == 200 and served.headers["x-agentkv-backend"] == "fast"


def test_an_upstream_error_keeps_its_status_and_openai_shape(gateway, fresh):
    """A backend's own 400 (not an overflow) reaches the client with its status, shape and the route headers."""
    answer = post(gateway, "/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3, "logprobs": True, "top_logprobs": 999})
    assert answer.status_code == 400 and answer.headers["x-agentkv-backend"] == "fast"
    assert set(answer.json()["error"]) >= {"message", "type", "code"}
    assert metric(gateway.root, "agentkv_gateway_upstream_errors_total", backend="fast", status="400") == 1


def test_a_fast_overflow_is_resent_to_slow(gateway, fresh):
    """Fast's window shrinks under the gateway: its overflow 400 is recovered on slow (reactive_escalate)."""
    messages = next(m for i, m in enumerate(conversation()) if i == 2)  # ~1,100 tokens: fits 2048, not 1024
    post(gateway, "/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2}).raise_for_status()  # fast's window discovered: 2048
    fresh["fast"].max_model_len = 1024
    answer = post(gateway, "/chat/completions", {"model": "m", "messages": messages, "tools": TOOLS8, "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["model"] == fresh["slow"].model_id
    assert (answer.headers["x-agentkv-backend"], answer.headers["x-agentkv-route"]) == ("slow", "reactive_escalate")
    assert metric(gateway.root, "agentkv_overflows_recovered_total") == 1


# ----------------------------------------------------------------------------- disconnects

def test_a_client_leaving_mid_stream_aborts_the_upstream_request(gateway, fresh):
    """Closing a stream after its first event closes the upstream request: the engine aborts it."""
    before = aborted(fresh["fast"])
    body = {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", gateway.base_url + "/chat/completions", json=body,
                         headers={"authorization": f"Bearer {ACME}"}) as response:
            assert response.headers["x-agentkv-backend"] == "fast"
            next(response.iter_lines())
    wait_for(lambda: aborted(fresh["fast"]) == before + 1, "the engine to abort the request")
    assert fresh["fast"].engine.stats().generation_tokens < 10**6


def test_a_client_leaving_a_whole_response_aborts_the_upstream_request(gateway, fresh):
    """A non-streamed request whose client gives up is cancelled upstream rather than generated to the end."""
    before = aborted(fresh["fast"])
    body = {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 1500,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(gateway, "/chat/completions", body, timeout=httpx.Timeout(30, read=0.3))
    wait_for(lambda: aborted(fresh["fast"]) == before + 1, "the engine to abort the request")


# ----------------------------------------------------------------------------- models, metrics, the map

def test_models_lists_agentkv_with_the_slow_window(gateway, fresh):
    """GET /v1/models: one model, id `agentkv`, max_model_len the slow backend's window."""
    answer = httpx.get(gateway.base_url + "/models", headers={"authorization": f"Bearer {ACME}"})
    assert [(m["id"], m["max_model_len"]) for m in answer.json()["data"]] == [("agentkv", 16384)]
    assert openai.OpenAI(base_url=gateway.base_url, api_key=ACME).models.list().data[0].id == "agentkv"


def test_metrics_count_requests_by_backend_and_route(gateway):
    """GET /metrics has the contract's families, counting what was answered."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}], "max_tokens": 2}
    for _ in range(3):
        post(gateway, "/chat/completions", body).raise_for_status()
    text = httpx.get(gateway.root + "/metrics").text
    for family in ("agentkv_requests_total", "agentkv_warms_total", "agentkv_overflows_recovered_total",
                   "agentkv_failovers_total", "agentkv_gateway_sessions"):
        assert f"# TYPE {family.removesuffix('_total')}" in text
    assert metric(gateway.root, "agentkv_requests_total", backend="fast", route="fits") == 3


def test_the_sessions_map_is_bounded(make_gateway):
    """Past max_sessions the least recently used conversation is dropped; the gauge says how many are held."""
    gateway = make_gateway(max_sessions=2)
    for n in range(4):
        post(gateway, "/chat/completions", {"model": "m", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": f"{uuid.uuid4()} {n}"}]})
    assert len(gateway.app.state.ctx.sessions) == 2 and metric(gateway.root, "agentkv_gateway_sessions") == 2


def test_a_long_conversation_holds_a_bounded_ledger(gateway):
    """One conversation (one x-session-id) for more turns than its ledger keeps: its Session holds the latest
    rows only, numbered by turn."""
    from agentkv.gateway.context import LEDGER_ROWS

    header = {"x-session-id": f"long-{uuid.uuid4()}"}
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {ACME}", **header}) as http:
        for n in range(LEDGER_ROWS + 8):
            http.post(gateway.base_url + "/chat/completions", json={
                "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": f"turn {n}"}]}).raise_for_status()
    (session,) = gateway.app.state.ctx.sessions.values()
    wait_for(lambda: len(session.ledger) and session.ledger[-1].turn == LEDGER_ROWS + 8, "the last turn's row")
    assert [row.turn for row in session.ledger] == list(range(9, LEDGER_ROWS + 9))


def test_short_requests_are_written_before_they_are_counted_and_sent_once(gateway, fresh):
    """Far from every boundary, fast gets each turn's request before the Session has counted it (presends), the
    Session's prepared try matches it byte for byte (nothing discarded), and each request reaches fast once."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    header = {"x-session-id": f"presend-{uuid.uuid4()}"}
    for n in range(6):
        answer = client.chat.completions.with_raw_response.create(
            model="any", max_tokens=4, messages=[{"role": "user", "content": f"ping number {n}"}], extra_headers=header)
        assert answer.headers["x-agentkv-backend"] == "fast" and answer.headers["x-agentkv-route"] == "fits"
    sent = [b for b in chat_requests(fresh["fast"]) if str(b["messages"][0]["content"]).startswith("ping number")]
    assert [b["messages"][0]["content"] for b in sent] == [f"ping number {n}" for n in range(6)]
    assert metric(gateway.root, "agentkv_gateway_presends_total") >= 4
    assert metric(gateway.root, "agentkv_gateway_presend_discarded_total") == 0


def test_a_presend_the_session_disagrees_with_is_abandoned_and_the_prepared_try_sent(gateway, fresh, monkeypatch):
    """When the prepared try differs from what was written early (here: another budget), the early request is
    abandoned and the prepared one answers."""
    from agentkv import Session

    original = Session.presend

    def stale(self, body):
        early = original(self, body)
        if early is not None:
            early.decision = early.decision.__class__(**{**early.decision.__dict__, "max_tokens": 3})
        return early

    monkeypatch.setattr(Session, "presend", stale)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)
    header = {"x-session-id": f"stale-{uuid.uuid4()}"}
    for n in range(4):
        answer = client.chat.completions.create(model="any", max_tokens=5, extra_headers=header,
                                                messages=[{"role": "user", "content": f"pong number {n}"}])
        assert answer.usage.completion_tokens <= 5
    assert metric(gateway.root, "agentkv_gateway_presend_discarded_total") >= 2
    kept = [b for b in chat_requests(fresh["fast"]) if str(b["messages"][0]["content"]).startswith("pong number")]
    assert all(b["max_tokens"] in (3, 5) for b in kept) and sum(b["max_tokens"] == 5 for b in kept) == 4
