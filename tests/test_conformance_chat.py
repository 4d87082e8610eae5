"""Chat completions behave as vLLM's documented API says, checked through the official openai SDK.

Written from vLLM's OpenAI-server contracts (sampling parameters, stream shapes, usage, echo, logprobs), against
an embedded server started with vLLM's defaults (no ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agentkv.embedded.server import LocalServer  # noqa: E402

MODEL = "conf-chat"
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]


@pytest.fixture(scope="module")
def server():
    with LocalServer.from_size("tiny", window=1024, model_id=MODEL, enable_prompt_tokens_details=False) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def create(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", MESSAGES), **kwargs)


def greedy(client, max_tokens=8, **kwargs):
    return create(client, max_tokens=max_tokens, temperature=0, **kwargs)


def test_usage_has_no_prompt_tokens_details_unless_enabled(client, server):
    """Like vLLM without --enable-prompt-tokens-details, usage carries no cached-token details."""
    usage = greedy(client, 3).usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens == 3 and usage.prompt_tokens_details is None
    with LocalServer(server.engine, enable_prompt_tokens_details=True) as detailed:
        body = httpx.post(detailed.api_base + "/chat/completions", timeout=30,
                          json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_n_returns_independent_samples(client):
    """n=3 with temperature > 0 returns three indexed choices that are not all the same."""
    response = create(client, max_tokens=12, temperature=0.9, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) > 1
    assert response.usage.completion_tokens == 36


def test_n_seeds_are_derived_as_vllm_does(client):
    """Choice i of a seeded n>1 request is the single request with seed + i, and reruns are identical."""
    both = create(client, max_tokens=10, temperature=1.0, n=2, seed=42)
    again = create(client, max_tokens=10, temperature=1.0, n=2, seed=42)
    second = create(client, max_tokens=10, temperature=1.0, seed=43)
    assert [c.message.content for c in both.choices] == [c.message.content for c in again.choices]
    assert both.choices[1].message.content == second.choices[0].message.content


def test_stop_string_cuts_the_output(client):
    """A stop string ends generation before it; finish_reason is stop and stop_reason names it."""
    text = greedy(client, 12).choices[0].message.content
    stop = text[3:6]
    choice = greedy(client, 12, stop=[stop]).choices[0]
    assert choice.message.content == text[: text.find(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    kept = greedy(client, 12, stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == text[: text.find(stop) + len(stop)]


def greedy_ids(server, count):
    """The greedy continuation of MESSAGES, as token ids, straight from the engine."""
    return server.engine.generate(server.engine.tokenize_chat(MESSAGES), count).token_ids


def test_stop_token_ids_end_the_sequence(client, server):
    """A token id in stop_token_ids ends the sequence there and is reported as the stop_reason."""
    third = greedy_ids(server, 3)[2]
    choice = greedy(client, 8, extra_body={"stop_token_ids": [third]}).choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == third


def test_min_tokens_holds_back_stop_tokens(client, server):
    """With min_tokens, stop token ids cannot end the sequence early: at least min_tokens are generated."""
    first = greedy_ids(server, 1)[0]
    short = greedy(client, 6, extra_body={"stop_token_ids": [first]})
    held = greedy(client, 6, extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert short.usage.completion_tokens == 1
    assert held.usage.completion_tokens >= 4


def test_logprobs_and_top_logprobs(client):
    """logprobs=True with top_logprobs=k returns one entry per token, each with k alternatives, all <= 0."""
    choice = greedy(client, 5, logprobs=True, top_logprobs=5).choices[0]
    assert len(choice.logprobs.content) == 5
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 5 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.logprob >= -9999.0
    zero = greedy(client, 2, logprobs=True, top_logprobs=0).choices[0]
    assert zero.logprobs.content[0].top_logprobs == []
    assert greedy(client, 2, logprobs=False).choices[0].logprobs is None


def test_prompt_logprobs(client):
    """prompt_logprobs gives None for the first prompt token, then a dict per token; absent when not asked."""
    response = greedy(client, 2, extra_body={"prompt_logprobs": 1})
    logprobs = response.model_extra["prompt_logprobs"]
    assert len(logprobs) == response.usage.prompt_tokens and logprobs[0] is None
    assert all(1 <= len(position) <= 2 for position in logprobs[1:])
    entry = next(iter(logprobs[3].values()))
    assert set(entry) == {"logprob", "rank", "decoded_token"}
    assert greedy(client, 2).model_extra["prompt_logprobs"] is None


def test_echo_with_continue_final_message(client):
    """echo prepends the final assistant message being continued; without echo it is not repeated."""
    saying = "An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a saying"}, {"role": "assistant", "content": saying}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    echoed = greedy(client, 4, messages=messages, extra_body={**extra, "echo": True}).choices[0].message.content
    plain = greedy(client, 4, messages=messages, extra_body={**extra, "echo": False}).choices[0].message.content
    assert echoed == saying + plain and saying not in plain


def test_logit_bias_steers_sampling(client):
    """A +100 logit_bias on one token id makes greedy decoding choose it every step."""
    choice = greedy(client, 4, logit_bias={"15339": 100}).choices[0]
    assert choice.message.content == "hello" * 4


def test_stream_sends_last_text_with_finish_reason(client):
    """The stream's last choice chunk carries both text and finish_reason, and the text equals the whole reply."""
    whole = greedy(client, 10)
    chunks = list(greedy(client, 10, stream=True))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0] is chunks[-1]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finishing[0].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_options(client):
    """include_usage adds one usage-only chunk; continuous_usage_stats puts a growing usage on every chunk."""
    chunks = list(greedy(client, 6, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in
              greedy(client, 10, stream=True, extra_body={"min_tokens": 10},
                     stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert counts[0] == 0 and counts[-1] == 10 and counts == sorted(counts)


def test_streamed_n_choices_both_advance(client):
    """A streamed n=2 request sends content for both choice indexes."""
    seen: dict[int, str] = {}
    for chunk in create(client, max_tokens=8, temperature=0.7, n=2, stream=True):
        for choice in chunk.choices:
            seen[choice.index] = seen.get(choice.index, "") + (choice.delta.content or "")
    assert set(seen) == {0, 1} and all(seen.values())


def test_tool_calls_absent_is_none_not_empty(client):
    """With tools offered but no call made, message.tool_calls is None (vLLM omits the field)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    message = greedy(client, 1, tools=tools).choices[0].message
    assert message.tool_calls is None


def test_x_request_id_header(server):
    """Every response carries X-Request-Id: the caller's own when it sent one, a fresh one otherwise."""
    mine = httpx.get(server.base_url + "/health", headers={"X-Request-Id": "abc-123"})
    fresh = httpx.get(server.base_url + "/v1/models")
    assert mine.headers["x-request-id"] == "abc-123" and len(fresh.headers["x-request-id"]) >= 16


def test_complex_content_equals_plain_text(client):
    """A list of text parts renders exactly as the same text given as a string (custom roles too)."""
    plain = greedy(client, 4, messages=[{"role": "my-role", "content": "what is 1+1?"}])
    parts = greedy(client, 4, messages=[{"role": "my-role", "content": [{"type": "text", "text": "what is 1+1?"}]}])
    assert plain.choices[0].message.content == parts.choices[0].message.content


def test_allowed_token_ids_restrict_the_output(client, server):
    """allowed_token_ids limits every generated token to the given ids."""
    allowed = [15339, 1917]  # "hello", " world"
    choice = create(client, max_tokens=6, temperature=1.0, seed=1,
                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True}).choices[0]
    ids = server.engine.tokenize_prompt(choice.message.content)
    assert ids and set(ids) <= set(allowed)


def test_continuous_usage_needs_include_usage(client):
    """continuous_usage_stats without include_usage adds no usage to any chunk, as in vLLM."""
    chunks = list(greedy(client, 4, stream=True,
                         stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)
