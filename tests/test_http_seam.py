"""The HTTP seam: the async drivers never make a sync HTTP call on the event loop, and one fake serves both paths."""

import asyncio
import json

import pytest
from raw_server import RawServer, json_answer

from agentkv import Backend, Session, WarmAheadPolicy, WindowDiscovery
from agentkv.http.transport import HttpError
from agentkv.testing import FakeHttp, models_answer
from agentkv.tokens.encodings import encode, get_encoding
from agentkv.tokens.templates import render_chat
from agentkv.warm import CooldownMap, InFlightLimit

FAST, SLOW = "http://127.0.0.1:9101/v1", "http://127.0.0.1:9102/v1"
WINDOWS = {FAST: 2048, SLOW: 16384}
SYSTEM = {"role": "system", "content": "You are a careful operations agent."}


def vllm_like(method, url, body):
    """/v1/models and /tokenize answered the way vLLM answers them (token ids from the ChatML template)."""
    base = url.rsplit("/", 1)[0]
    if method == "GET" and url.endswith("/models"):
        model = "fast-m" if base == FAST else "slow-m"
        return models_answer(model, WINDOWS[base])
    if method == "POST" and url.endswith("/tokenize"):
        text = render_chat(body["messages"], body.get("tools"),
                           add_generation_prompt=body.get("add_generation_prompt", True))
        tokens = encode(get_encoding(), text)
        return {"count": len(tokens), "max_model_len": WINDOWS[base + "/v1"], "tokens": tokens, "token_strs": None}
    if method == "POST" and url.endswith("/chat/completions") and body.get("max_tokens") == 1:  # a warm
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "."}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    return 404, {"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}}


class Answers:
    """A completion client that answers every request with a short reply and vLLM-style usage."""

    def __init__(self):
        self.sent = []

    def _answer(self, kwargs):
        self.sent.append(kwargs)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}

    def completion(self, **kwargs):
        return self._answer(kwargs)

    async def acompletion(self, **kwargs):
        await asyncio.sleep(0)
        return self._answer(kwargs)


def turns(n):
    """A conversation growing by ~150 tokens a turn."""
    messages = [SYSTEM]
    for i in range(n):
        messages = messages + [{"role": "user", "content": f"Step {i}: " + "check the disk latency graphs " * 20},
                               {"role": "assistant", "content": f"Noted step {i}."}]
        yield messages + [{"role": "user", "content": "What next?"}]


def make_session(http, declared):
    fast = Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=2048 if declared else None)
    slow = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow", window=16384 if declared else None)
    return Session(fast, slow, discovery=WindowDiscovery(http=http), http=http, client=Answers(),
                   cooldowns=CooldownMap(), in_flight=InFlightLimit(4), tenant="t", cache_salt_secret="k",
                   warm_ahead=WarmAheadPolicy())


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "discovered"])
async def test_async_escalation_after_a_warm_makes_no_sync_http_call(declared):
    """acompletion, aobserve and aroute through a warm and an escalation make every HTTP call async."""
    http = FakeHttp(vllm_like)
    s = make_session(http, declared)
    for messages in turns(30):
        await s.acompletion(messages=messages, max_tokens=8)
        if s.last_route.role == "slow":
            break
    await s.adrain_warms(10)
    await s.aobserve(messages=messages, max_tokens=8)
    await s.aroute(messages=messages, max_tokens=8)
    report = await s.aprefix_report()  # the last two requests: the escalated one and its observed repeat
    assert report is not None and report.intact and report.exact
    assert s.last_route.role == "slow" and s.stats()["warm_fired"] == 1 and s.stats()["escalations_after_warm"] == 1
    assert any(c.url.endswith("/tokenize") for c in http.calls)
    assert any(c.url.endswith("/models") for c in http.calls)  # the slow model's listing, also when declared
    assert http.blocking_calls == [] and all(c.asynchronous for c in http.calls)


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "discovered"])
def test_sync_escalation_goes_through_the_same_fake(declared):
    """completion uses the same injected fake for /models and /tokenize, synchronously."""
    http = FakeHttp(vllm_like)
    s = make_session(http, declared)
    for messages in turns(30):
        s.completion(messages=messages, max_tokens=8)
        if s.last_route.role == "slow":
            break
    assert s.drain_warms(10)
    assert s.last_route.role == "slow" and s.stats()["warm_fired"] == 1 and s.stats()["escalations_after_warm"] == 1
    assert http.calls and not any(c.asynchronous for c in http.calls)
    assert {c.url.rsplit("/", 1)[1] for c in http.calls} == {"models", "tokenize", "completions"}  # + the warm
    assert s.stats()["warm_completed"] == 1


async def test_the_spy_sees_a_sync_call_made_on_the_loop():
    """The check itself: a sync call made while the loop runs is reported as blocking."""
    http = FakeHttp(vllm_like)
    http.request("GET", FAST + "/models", timeout_s=1.0)
    assert len(http.blocking_calls) == 1


# ----------------------------------------------------------------------------- issue 21: bounds on what servers send

MODELS = json_answer(200, models_answer("fast-m", 2048))
HEAD, BODY = MODELS[:MODELS.index(b"\r\n\r\n") + 4], MODELS[MODELS.index(b"\r\n\r\n") + 4:]


def _call(transport, url, asynchronous):
    if asynchronous:
        return asyncio.run(transport.arequest("GET", url, timeout_s=0.5))
    return transport.request("GET", url, timeout_s=0.5)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("drip", ["headers", "body"])
def test_timeout_s_is_a_deadline_for_the_whole_call(drip, asynchronous):
    """A server trickling its answer a byte every 50 ms (about 12 s for all of it) is cut off at timeout_s=0.5,
    whether it trickles the headers or the body: timed_out, long before its last byte."""
    from agentkv.http.transport import HttpxTransport

    head, payload = (b"", MODELS) if drip == "headers" else (HEAD, BODY)
    with RawServer("drip", head=head, payload=payload, every=0.05) as server:
        with pytest.raises(HttpError) as caught:
            _call(HttpxTransport(), server.url + "/v1/models", asynchronous)
        assert caught.value.kind == "timeout" and server.sent < len(payload)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_answer_past_the_size_cap_is_refused_as_it_streams_in(asynchronous):
    """A 64 MiB answer to a transport capped at 1 MiB is refused once the cap is passed, not read whole first; the
    default transport refuses one past 16 MiB."""
    from agentkv.http.transport import DEFAULT_MAX_ANSWER_BYTES, HttpxTransport

    with RawServer("big", size=64 * 2**20) as server:
        with pytest.raises(HttpError, match="larger than 1048576 bytes") as caught:
            _call(HttpxTransport(max_answer_bytes=2**20), server.url + "/v1/models", asynchronous)
        assert caught.value.kind == "too_large" and caught.value.status_code is None
        assert server.sent < 64 * 2**20
    assert DEFAULT_MAX_ANSWER_BYTES == 16 * 2**20
    with RawServer("big", size=DEFAULT_MAX_ANSWER_BYTES + 1) as server:
        with pytest.raises(HttpError, match="larger than"):
            _call(HttpxTransport(), server.url + "/v1/models", asynchronous)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_deeply_nested_answer_is_an_http_error(asynchronous):
    """JSON nested 100,000 deep (RecursionError in the parser) is an HttpError like any answer that is not JSON."""
    from agentkv.http.transport import HttpxTransport

    nested = b"[" * 100_000 + b"]" * 100_000
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(nested) + nested
    with RawServer("raw", payload=answer) as server:
        with pytest.raises(HttpError, match="non-JSON") as caught:
            _call(HttpxTransport(), server.url + "/v1/models", asynchronous)
        assert caught.value.kind == "status" and caught.value.status_code == 200


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_whole_answer_within_the_bounds_still_parses(asynchronous):
    """The bounded read changes nothing for an ordinary answer: /v1/models parses, twice over the pooled client."""
    from agentkv.http.transport import HttpxTransport

    transport = HttpxTransport()
    with RawServer("raw", payload=MODELS) as server:
        if asynchronous:
            async def twice():
                return [await transport.arequest("GET", server.url + "/v1/models", timeout_s=2.0) for _ in range(2)]
            answers = asyncio.run(twice())
        else:
            answers = [transport.request("GET", server.url + "/v1/models", timeout_s=2.0) for _ in range(2)]
    assert answers == [models_answer("fast-m", 2048)] * 2


# ----------------------------------------------------------------------------- one seam, two implementations, one fake

def _relayed(upstream, fast, slow, body, models=("fast-m", "slow-m")):
    """``body`` through the gateway's relay over ``upstream`` (any HttpTransport): (status, content type, body bytes
    or the joined stream, the Session)."""
    from agentkv.gateway.config import GatewayConfig
    from agentkv.gateway.context import GatewayContext
    from agentkv.gateway.relay import relay

    async def run():
        ctx = GatewayContext(GatewayConfig(fast_url=fast, fast_model=models[0], slow_url=slow, slow_model=models[1]),
                             upstream=upstream)
        session = ctx.session("anonymous", "c1")
        reply = await relay(ctx, session, body)
        content = reply.body if reply.chunks is None else b"".join([c async for c in reply.chunks])
        if reply.finish is not None:
            reply.finish()
        await ctx.aclose()
        return reply.status, reply.content_type, content, session

    return asyncio.run(run())


def test_every_implementation_is_the_one_http_transport():
    """The httpx transport, the gateway's lean client and the fake all satisfy the one HttpTransport Protocol."""
    from agentkv import HttpTransport
    from agentkv.http.transport import HttpxTransport
    from agentkv.gateway.upstream import Upstream

    for transport in (HttpxTransport(), Upstream(), FakeHttp(vllm_like)):
        assert isinstance(transport, HttpTransport), type(transport).__name__


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_gateway_relays_over_the_fake_which_also_serves_the_sessions_json_calls(stream):
    """The relay's raw POSTs and the Session's JSON calls (discovery) go through one FakeHttp: a JSON answer comes back
    whole, a stream chunk by chunk, and the Session records the stream's usage."""
    answer = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
              "content": "ok"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    chunks = [b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n',
              b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1, '
              b'"prompt_tokens_details": {"cached_tokens": 0}}}\n\n', b"data: [DONE]\n\n"]

    def handler(method, url, body):
        if url.endswith("/chat/completions") and body.get("max_tokens") != 1:
            return chunks if body.get("stream") else answer
        return vllm_like(method, url, body)

    http = FakeHttp(handler)
    body = {"model": "fast-m", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 8,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})}
    status, kind, content, session = _relayed(http, FAST, SLOW, body)
    assert status == 200 and content == (b"".join(chunks) if stream else json.dumps(answer).encode())
    assert kind == ("text/event-stream" if stream else "application/json")
    posted = [c for c in http.calls if c.url.endswith("/chat/completions")]
    assert [c.body["messages"] for c in posted] == [body["messages"]]
    assert any(c.url.endswith("/models") for c in http.calls)  # the Session's discovery, through the same fake


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_gateway_relays_over_the_httpx_transport_too(servers, stream):
    """The relay over HttpxTransport (the other implementation) against the embedded servers: a JSON answer whole, a
    stream passed on to its end, as over the lean client."""
    from agentkv.http.transport import HttpxTransport

    fast, slow = servers
    body = {"model": fast.model_id, "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 4,
            **({"stream": True} if stream else {})}
    status, kind, content, _ = _relayed(HttpxTransport(), fast.api_base, slow.api_base, body,
                                        models=(fast.model_id, slow.model_id))
    assert status == 200, content[:300]
    if stream:
        assert kind.startswith("text/event-stream") and content.rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(content)["choices"][0]["message"]["role"] == "assistant"


# ----------------------------------------------------------------------------- one error: HttpError, by kind

def test_the_httpx_raw_post_raises_the_seams_error_never_httpx_s():
    """A raw POST to a port nothing listens on: an HttpError of kind "outage" (its httpx error the cause), which
    outage_cause reads as "refused", as it read httpx's own."""
    import socket

    from agentkv.http.transport import HttpxTransport
    from agentkv.retry import is_transient, outage_cause

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(HttpError) as caught:
        asyncio.run(HttpxTransport(connect_timeout_s=2.0).post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}"))
    assert caught.value.kind == "outage" and caught.value.status_code is None
    assert outage_cause(caught.value) == "refused" and is_transient(caught.value)


def test_a_raw_stream_cut_by_the_server_is_an_http_error():
    """A chunked answer whose connection closes mid-body: reading it raises an HttpError of kind "outage" through the
    httpx transport too (never httpx's RemoteProtocolError)."""
    from agentkv.http.transport import HttpxTransport

    cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"

    async def read(url):
        transport = HttpxTransport()
        answer = await transport.post(url, b"{}")
        try:
            return await answer.aread()
        finally:
            await answer.aclose()
            await transport.aclose()

    with RawServer("raw", payload=cut) as server:
        with pytest.raises(HttpError) as caught:
            asyncio.run(read(server.url + "/v1/chat/completions"))
    assert caught.value.kind == "outage"


@pytest.mark.parametrize("error, cause", [
    (HttpError("refused", kind="outage", reason="refused"), "refused"),
    (HttpError("closed", kind="outage"), "dropped"),
    (HttpError("slow", kind="timeout"), "timeout"),
    (HttpError("connect took too long", kind="timeout", reason="unreachable"), "unreachable"),
    (HttpError("503", kind="status", status_code=503), "unavailable"),
    (HttpError("404", kind="status", status_code=404), None),
    (HttpError("too big", kind="too_large"), None),
], ids=["refused", "dropped", "timeout", "connect-timeout", "503", "404", "too-large"])
def test_outage_cause_reads_the_kind_of_the_seams_error(error, cause):
    """agentkv.retry reads an HttpError by its kind (and reason), its status by status_code."""
    from agentkv.retry import outage_cause

    assert outage_cause(error) == cause


def test_the_fake_serves_text_and_json_through_one_request_method():
    """FakeHttp.request / arequest: the handler's answer parsed (text=True: as text), a status >= 400 an HttpError of
    kind "status", a latency past the call's deadline one of kind "timeout"."""
    http = FakeHttp(lambda method, url, body: (404, {}) if url.endswith("/gone") else "# metrics\n"
                    if url.endswith("/metrics") else {"echo": body})
    assert http.request("GET", FAST + "/metrics", timeout_s=1.0, text=True) == "# metrics\n"
    assert asyncio.run(http.arequest("POST", FAST + "/x", json={"a": 1}, timeout_s=1.0)) == {"echo": {"a": 1}}
    with pytest.raises(HttpError) as caught:
        http.request("GET", FAST + "/gone", timeout_s=1.0)
    assert (caught.value.kind, caught.value.status_code) == ("status", 404)
    with pytest.raises(HttpError) as caught:
        FakeHttp(lambda *a: {}, latency_s=0.05).request("GET", FAST + "/models", timeout_s=0.01)
    assert caught.value.kind == "timeout"
    assert [(c.method, c.asynchronous) for c in http.calls] == [("GET", False), ("POST", True), ("GET", False)]


def test_a_gateway_whose_backends_cannot_be_reached_answers_502_from_the_seams_error():
    """The relay reads the seam's HttpError: a raw POST that raises one of kind "outage" on both backends is the
    gateway's own 502, naming how it failed."""
    def handler(method, url, body):
        if url.endswith("/chat/completions"):
            raise HttpError("cannot connect", kind="outage", reason="refused")
        return vllm_like(method, url, body)

    body = {"model": "fast-m", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 8}
    status, _, content, _ = _relayed(FakeHttp(handler), FAST, SLOW, body)
    assert status == 502 and "(refused)" in json.loads(content)["error"]["message"]
