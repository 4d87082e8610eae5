"""The local server through real litellm (``hosted_vllm/...``), as agentkv's Session will call it."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from agentkv._support.env import import_litellm  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402

litellm = import_litellm()

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
MESSAGES = [
    {"role": "system", "content": "You are a dictionary agent with one tool. Be terse. " * 6},
    {"role": "user", "content": "Define 'ephemeral'."},
]


@pytest.fixture(scope="module")
def server():
    with LocalServer.from_size("tiny", window=1024, model_id="agentkv-small", request_log=100) as running:
        yield running


def call(server, **kwargs):
    return litellm.completion(model="hosted_vllm/agentkv-small", api_base=server.api_base, messages=MESSAGES,
                              num_retries=0, **kwargs)


def test_completion_with_tools_and_salt(server):
    """litellm sends tools, max_tokens and an extra_body cache_salt; the reply and usage come back."""
    server.clear_requests()
    response = call(server, tools=TOOLS, max_tokens=3, extra_body={"cache_salt": "tenant-1"})
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3
    sent = server.requests[-1].body
    assert sent["model"] == "agentkv-small" and sent["cache_salt"] == "tenant-1" and sent["tools"] == TOOLS


def test_cached_tokens_reach_litellm_usage(server):
    """A repeated prefix under the same salt shows up as usage.prompt_tokens_details.cached_tokens."""
    call(server, tools=TOOLS, max_tokens=2, extra_body={"cache_salt": "tenant-2"})
    response = call(server, tools=TOOLS, max_tokens=2, extra_body={"cache_salt": "tenant-2"})
    assert response.usage.prompt_tokens_details.cached_tokens > 0


def test_overflow_raises_context_window_exceeded_with_the_servers_message(server):
    """A prompt over the window surfaces as litellm.ContextWindowExceededError carrying vLLM 0.32's message."""
    with pytest.raises(litellm.ContextWindowExceededError) as caught:
        litellm.completion(model="hosted_vllm/agentkv-small", api_base=server.api_base, num_retries=0,
                           messages=[{"role": "user", "content": "word " * 1500}], max_tokens=4)
    assert "This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025 " \
           "input tokens, which exceeds this limit even without any output tokens." in str(caught.value)
    assert isinstance(caught.value, litellm.BadRequestError)


def test_streaming_through_litellm(server):
    """A streamed completion through litellm yields the same text as the non-streamed one, and usage."""
    whole = call(server, max_tokens=4).choices[0].message.content
    chunks = list(call(server, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert any(getattr(c, "usage", None) and c.usage.completion_tokens == 4 for c in chunks)
