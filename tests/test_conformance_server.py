"""The rest of vLLM's server surface: /v1/completions, /detokenize, /version, /invocations, metrics, cancellation.

Metric names, labels and the per-request counts follow vLLM's metrics tests; cancellation follows its contract that
an aborted request leaves ``num_requests_running``, ``num_requests_waiting`` and ``kv_cache_usage_perc`` at 0.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from agentkv.embedded.server import LocalServer  # noqa: E402

MODEL = "conf-server"
PROMPT = "Hello my name is Robert and I love magic"
EXPECTED_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:request_success_total", *(f"vllm:{name}_{suffix}" for name in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for suffix in ("sum", "bucket", "count")),
]


@pytest.fixture(scope="module")
def server():
    with LocalServer.from_size("tiny", window=1024, model_id=MODEL, enable_prompt_tokens_details=False) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def samples(server) -> dict[str, float]:
    """Every unlabelled-by-bucket sample of /metrics, by sample name (buckets skipped)."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_bucket") and s.labels.get("finished_reason") in (None, "length")}


def wait_idle(server, timeout=10.0) -> float:
    """Seconds until the engine has no running or waiting request."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        stats = server.engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return time.perf_counter() - started
        time.sleep(0.005)
    raise AssertionError("the engine never went idle")


def test_completions_text_and_token_prompts(client, server):
    """A text prompt and its token ids give the same greedy completion; usage counts the prompt tokens."""
    ids = server.engine.tokenize_prompt(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].finish_reason == "length"
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 5


def test_completions_batch_and_n_indexes(client):
    """Two prompts with n=2 give four choices indexed prompt * n + i."""
    response = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 8


def test_completions_echo_with_logprobs(client, server):
    """echo puts the prompt first in the text and in the logprobs, whose first entry is null."""
    ids = server.engine.tokenize_prompt(PROMPT)
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2,
                                       temperature=0).choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).choices[0]
    assert choice.text == PROMPT + plain.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])


def test_completions_stream(client):
    """A streamed completion sends text chunks, the last one with finish_reason, then a usage chunk."""
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6


def test_detokenize_round_trip(server):
    """/detokenize returns the text of /tokenize's tokens."""
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": tokens}).json() == {"prompt": PROMPT}


def test_version_and_ping(server):
    """/version reports a version string; /ping answers 200 like /health."""
    assert isinstance(httpx.get(server.base_url + "/version").json()["version"], str)
    assert httpx.get(server.base_url + "/ping").status_code == 200


def test_invocations_routes_by_body(client, server):
    """/invocations answers a chat body like /v1/chat/completions and a prompt body like /v1/completions."""
    request = {"model": MODEL, "messages": [{"role": "user", "content": "1+1?"}], "max_tokens": 5, "temperature": 0}
    chat = client.chat.completions.create(**request).model_dump()
    via = httpx.post(server.base_url + "/invocations", json=request, timeout=30).json()
    assert set(via) <= set(chat) and via["object"] == "chat.completion"
    assert via["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    text = httpx.post(server.base_url + "/invocations", json={"prompt": "a", "max_tokens": 2}, timeout=30).json()
    assert text["object"] == "text_completion"


def test_metrics_names_and_counts(client, server):
    """Every vLLM metric name is exposed, and 3 requests of max_tokens 4 move the counts by exactly that much."""
    ids = server.engine.tokenize_prompt(PROMPT)
    before = samples(server)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body={"ignore_eos": True})
    after = samples(server)
    text = httpx.get(server.base_url + "/metrics").text
    assert all(name in text for name in EXPECTED_METRICS)

    def moved(name):
        return after[name] - before.get(name, 0.0)

    assert moved("vllm:request_prompt_tokens_sum") == 3 * len(ids) and moved("vllm:request_prompt_tokens_count") == 3
    assert moved("vllm:request_generation_tokens_sum") == 12
    assert moved("vllm:request_params_max_tokens_sum") == 12 and moved("vllm:request_params_n_count") == 3
    assert moved("vllm:iteration_tokens_total_sum") == 3 * (len(ids) + 4)
    assert moved("vllm:iteration_tokens_total_count") == 12
    assert moved("vllm:inter_token_latency_seconds_count") == 9
    assert moved("vllm:time_to_first_token_seconds_count") == 3 and moved("vllm:e2e_request_latency_seconds_count") == 3
    assert moved("vllm:prompt_tokens_total") == 3 * len(ids) and moved("vllm:generation_tokens_total") == 12
    assert moved("vllm:request_success_total") == 3


def test_gauges_are_zero_when_idle(server):
    """With nothing in flight, running, waiting and KV usage are all 0."""
    wait_idle(server)
    now = samples(server)
    assert now["vllm:num_requests_running"] == now["vllm:num_requests_waiting"] == 0
    assert now["vllm:kv_cache_usage_perc"] == 0


def test_stream_disconnect_aborts_the_request(server):
    """A client that drops a stream mid-way has its request aborted: the engine goes idle, KV usage back to 0."""
    aborted = server.engine.stats().requests_finished.get("abort", 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.api_base + "/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)
            assert server.engine.stats().running == 1 and samples(server)["vllm:kv_cache_usage_perc"] > 0
    wait_idle(server)
    assert server.engine.stats().requests_finished["abort"] == aborted + 1
    assert samples(server)["vllm:kv_cache_usage_perc"] == 0


def test_non_streaming_disconnect_aborts_the_request(server):
    """A client that times out on a whole-response request has it aborted rather than generated to the end."""
    aborted = server.engine.stats().requests_finished.get("abort", 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.api_base + "/completions", json=body, timeout=httpx.Timeout(30, read=0.15))
    wait_idle(server)
    assert server.engine.stats().requests_finished["abort"] == aborted + 1
    assert server.engine.stats().generation_tokens < 10**6


def test_concurrent_requests_interleave(server):
    """A short request sent while a long one streams finishes first: running requests take turns per token."""
    long_done = threading.Event()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}

    def long_stream():
        with httpx.stream("POST", server.api_base + "/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                pass
        long_done.set()

    worker = threading.Thread(target=long_stream)
    worker.start()
    while server.engine.stats().running == 0:
        time.sleep(0.005)
    short = httpx.post(server.api_base + "/completions", timeout=60,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert short.status_code == 200 and not long_done.is_set()
    worker.join()
    assert long_done.is_set()


def test_a_request_waits_while_the_model_is_busy(server):
    """While another turn holds the model, a new request is counted in num_requests_waiting, then runs."""
    engine = server.engine
    results = []
    engine._lock.acquire()
    try:
        worker = threading.Thread(target=lambda: results.append(engine.generate([1, 2, 3], 2)))
        worker.start()
        deadline = time.monotonic() + 10
        while engine.stats().waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert samples(server)["vllm:num_requests_waiting"] == 1
    finally:
        engine._lock.release()
    worker.join()
    assert results[0].completion_tokens == 2 and engine.stats().waiting == 0


def test_abandoned_requests_do_not_starve_the_next(server):
    """Requests whose clients time out are cancelled, so a later request is answered promptly (vLLM's test)."""
    import asyncio

    async def flood() -> None:
        async with openai.AsyncOpenAI(base_url=server.api_base, api_key="unused", max_retries=0,
                                      timeout=0.3) as hasty:
            calls = [hasty.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "story"}],
                                                   max_tokens=900, extra_body={"min_tokens": 900})
                     for _ in range(6)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, openai.APITimeoutError) for o in outcomes)

    asyncio.run(flood())
    wait_idle(server)
    with openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0, timeout=5) as patient:
        reply = patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5)
    assert len(reply.choices) == 1 and server.engine.stats().requests_finished["abort"] >= 6


def test_load_reports_requests_in_flight(server):
    """/load is 0 when idle and counts a request while it runs."""
    assert httpx.get(server.base_url + "/load").json() == {"server_load": 0}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.api_base + "/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the connection, which aborts the request
        next(lines)
        assert httpx.get(server.base_url + "/load").json() == {"server_load": 1}
    wait_idle(server)
    assert httpx.get(server.base_url + "/load").json() == {"server_load": 0}


def test_tokenizer_info(server):
    """/tokenizer_info names the tokenizer class, its EOS token, the window and the chat template."""
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "<|endoftext|>"
    assert info["model_max_length"] >= 1024 and "im_start" in info["chat_template"]
    assert all(entry["special"] is True for entry in info["added_tokens_decoder"].values())


def test_return_token_ids(client, server):
    """return_token_ids adds prompt_token_ids and token_ids that decode to the prompt and the text."""
    extra = {"return_token_ids": True}
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                           extra_body=extra).choices[0]
    assert completion.model_extra["prompt_token_ids"] == server.engine.tokenize_prompt(PROMPT)
    assert server.engine.decode(completion.model_extra["token_ids"]).startswith(completion.text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body=extra)
    assert "hi" in server.engine.decode(chat.model_extra["prompt_token_ids"])
    assert len(chat.choices[0].model_extra["token_ids"]) == 4
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0]
    assert plain.model_extra.get("token_ids") is None


def test_streamed_token_ids_match_logprob_tokens(client):
    """Streaming with return_token_ids and return_tokens_as_token_ids: ids per chunk equal the logprob tokens."""
    streamed, from_logprobs, prompt_ids = [], [], None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                           logprobs=1, extra_body={"return_token_ids": True,
                                                                   "return_tokens_as_token_ids": True}):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        prompt_ids = prompt_ids or choice.model_extra.get("prompt_token_ids")
        streamed += choice.model_extra["token_ids"]
        from_logprobs += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert prompt_ids and len(streamed) == 8 and streamed == from_logprobs
    chat_ids = []
    for index, chunk in enumerate(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
            extra_body={"return_token_ids": True})):
        assert ("prompt_token_ids" in chunk.model_extra) == (index == 0)
        chat_ids += chunk.choices[0].model_extra.get("token_ids") or []
    assert len(chat_ids) == 5
