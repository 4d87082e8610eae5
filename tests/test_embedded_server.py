"""The local server speaks vLLM's OpenAI-compatible wire format over real HTTP."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.engine.models import build_model  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402

MODEL_ID = "agentkv-tiny"
WINDOW = 1024
TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
MESSAGES = [
    {"role": "system", "content": "You are a research agent. Think step by step. " * 6},
    {"role": "user", "content": "Find the population of Lyon."},
]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture
def server(model):
    engine = LocalEngine(model, model_id=MODEL_ID, max_model_len=WINDOW)
    with LocalServer(engine, request_log=100) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        yield http


def chat(**extra):
    return {"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def metric(text: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{[^}}]*model_name="{MODEL_ID}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_server_binds_loopback_and_exposes_its_urls(server):
    """The server listens on 127.0.0.1 and reports base_url and api_base (base_url + /v1)."""
    assert server.base_url == f"http://127.0.0.1:{server.port}" and server.port > 0
    assert server.api_base == server.base_url + "/v1"


def test_models_lists_the_served_model_and_window(client):
    """GET /v1/models returns vLLM's model card fields, including max_model_len."""
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL_ID and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["max_model_len"] == WINDOW and card["parent"] is None
    assert isinstance(card["created"], int) and card["root"]


def test_window_and_model_id_change_at_runtime(server, client):
    """A new max_model_len and model id (a swap slot loading another model) show from the next request."""
    server.max_model_len = 4096
    server.model_id = "agentkv-other"
    (card,) = client.get("/v1/models").json()["data"]
    assert (card["id"], card["max_model_len"]) == ("agentkv-other", 4096)
    assert client.post("/v1/chat/completions", json=chat(model="agentkv-other")).status_code == 200


def test_chat_completion_response_shape(client):
    """A chat completion is a chat.completion object with one assistant choice and full usage."""
    body = client.post("/v1/chat/completions", json=chat()).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL_ID
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    # in-process servers enable the details; vLLM 0.32's carry the tokens this request wrote to the prefix cache
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "multimodal_tokens": None,
                                              "created_cache_tokens": usage["prompt_tokens"] // 16 * 16}
    assert usage["completion_tokens_details"] is None and body["system_fingerprint"].startswith("agentkv-")


def test_repeated_prefix_reports_cached_tokens(client):
    """The second request with the same prefix and salt reports cached_tokens > 0; another salt does not."""
    client.post("/v1/chat/completions", json=chat(cache_salt="alpha"))
    again = client.post("/v1/chat/completions", json=chat(cache_salt="alpha")).json()["usage"]
    other = client.post("/v1/chat/completions", json=chat(cache_salt="beta")).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (again["prompt_tokens"] - 1) // 16 * 16 > 0
    assert other["prompt_tokens_details"]["cached_tokens"] == 0


def test_prompt_plus_max_tokens_over_the_window_is_clamped_silently(server, client):
    """prompt + max_tokens over the window is served, as vLLM 0.32 does: 200, the rest of the window, "length"."""
    server.max_model_len = 120
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 100, "ignore_eos": True}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] + 100 > 120
    assert answer["usage"]["total_tokens"] == 120 and answer["choices"][0]["finish_reason"] == "length"


def test_prompt_over_the_window_is_refused_with_the_032_wording(client):
    """A prompt longer than the window is a 400 naming the 'at least L+1' threshold, as vLLM 0.32 answers."""
    long = [{"role": "user", "content": "word " * 1500}]
    response = client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": long, "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": (
        "This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=1025)"), "type": "BadRequestError", "param": "input_tokens",
        "code": 400}


def test_default_max_tokens_fills_the_window(server, client):
    """Without max_tokens the request may run to the end of the window (finish_reason 'length')."""
    server.max_model_len = 120
    usage = client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": MESSAGES}).json()["usage"]
    assert usage["total_tokens"] == 120


def test_unknown_model_is_404(client):
    """A model id the server does not serve is a 404 NotFoundError, as vLLM answers."""
    response = client.post("/v1/chat/completions", json=chat(model="gpt-9"))
    assert response.status_code == 404
    assert response.json()["error"]["message"] == f"The model `gpt-9` does not exist. Valid aliases: {MODEL_ID}."


@pytest.mark.parametrize(("body", "kind", "param"), [
    (b"{not json", "Bad Request", "body.1"), (b'["a list"]', "Bad Request", "body"),
    (b'{"messages": "hi"}', "Bad Request", "body.messages"), (b"", "Bad Request", "body"),
    (b'{"messages": [], "max_tokens": 0}', "BadRequestError", None),
    (b'{"messages": [], "cache_salt": ""}', "BadRequestError", "cache_salt"),
    (b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": "a/b"}', "BadRequestError", "cache_salt")])
def test_malformed_bodies_are_400_error_json(client, body, kind, param):
    """Malformed JSON and schema failures are vLLM's "Bad Request" with the location; field checks BadRequestError."""
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == (kind, param)


def test_an_empty_messages_list_is_a_400_not_a_500(client):
    """No messages is vLLM's 400 "Cannot apply chat template to an empty conversation", not a template crash."""
    response = client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": [], "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ("Cannot apply chat template to an empty conversation. Provide at "
                                                   "least one message.")


def test_a_deeply_nested_body_is_a_400_not_a_500(client):
    """A body nested 100k deep (RecursionError in the JSON parser) is FastAPI's 400, as vLLM answers."""
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert (response.status_code, response.json()) == (400, {"detail": "There was an error parsing the body"})


def test_streaming_sends_chunks_usage_and_done(client):
    """stream=True sends SSE chat.completion.chunk events: role, content, finish, usage, then [DONE]."""
    with client.stream("POST", "/v1/chat/completions",
                       json=chat(stream=True, stream_options={"include_usage": True})) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    whole = client.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]["content"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == whole


def test_streaming_without_include_usage_sends_no_usage_chunk(client):
    """Without stream_options.include_usage no chunk carries usage."""
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert all("usage" not in c for c in chunks)


def test_tokenize_chat_count_equals_the_prompt_tokens_of_the_chat_endpoint(client):
    """/tokenize (chat form) counts exactly the prompt the chat endpoint prefills."""
    counted = client.post("/tokenize", json={"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS}).json()
    usage = client.post("/v1/chat/completions", json=chat()).json()["usage"]
    assert counted["count"] == usage["prompt_tokens"] == len(counted["tokens"])
    assert counted["max_model_len"] == WINDOW


def test_tokenize_prompt_form(client):
    """/tokenize (prompt form) returns the prompt's tokens, and token strings when asked."""
    body = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert body["count"] == 2 and body["tokens"] == [15339, 1917]
    assert body["token_strs"] == ["hello", " world"]
    assert client.post("/tokenize", json={"prompt": "hello"}).json()["token_strs"] is None


def test_metrics_counters_increase(client):
    """/metrics exposes vLLM's prefix-cache and request counters, which grow with traffic."""
    before = client.get("/metrics").text
    client.post("/v1/chat/completions", json=chat())
    client.post("/v1/chat/completions", json=chat())
    after = client.get("/metrics").text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"):
        assert metric(after, name) > metric(before, name)
    assert "# TYPE vllm:prefix_cache_hits_total counter" in after
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="agentkv-tiny"} 2.0' in after


def test_health_and_unknown_paths(client):
    """/health is 200; an unknown path is FastAPI's 404 and a wrong method its 405."""
    assert client.get("/health").status_code == 200
    assert client.get("/v2/nothing").status_code == 404
    assert client.get("/v1/chat/completions").status_code == 405


def test_requests_are_logged_for_tests(server, client):
    """Every request is logged with method, path and parsed body until clear_requests()."""
    client.get("/v1/models")
    client.post("/tokenize", json={"prompt": "x"})
    assert [(r.method, r.path, r.body) for r in server.requests] == [
        ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "x"})]
    server.clear_requests()
    assert server.requests == []


def test_stop_releases_the_port(model):
    """After stop() the port no longer accepts connections, even with a keep-alive client open."""
    server = LocalServer(LocalEngine(model, max_model_len=WINDOW)).start()
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/health").status_code == 200
        server.stop()
        with pytest.raises(httpx.TransportError):
            http.get("/health")


def test_backend_counts_exactly_what_the_server_prefills(server, client):
    """server.backend() addresses this server, and agentkv's counter for it equals the server's prompt_tokens."""
    from agentkv.tokens import TokenCounter, payload_from_request

    backend = server.backend()
    assert backend.model == f"hosted_vllm/{MODEL_ID}" and backend.api_base == server.api_base
    assert backend.window is None and server.backend(declare_window=True).window == WINDOW
    counted = TokenCounter.for_backend(backend, use_server=False).count(
        payload_from_request({"messages": MESSAGES, "tools": TOOLS}))
    usage = client.post("/v1/chat/completions", json=chat()).json()["usage"]
    assert counted.exact and counted.total == usage["prompt_tokens"]
