"""Token accounting counts what the backend receives, exactly where it can, incrementally."""

import json

import pytest

from agentkv.http.transport import HttpError
from agentkv.testing import FakeHttp
from agentkv.tokens.encodings import encode, get_encoding
from agentkv.tokens.templates import render_chat
from agentkv.tokens import (
    CharSource, ChunkedEncoder, Payload, ServerSource, TemplateSource, TiktokenSource, TokenCounter,
    payload_from_request,
)
from agentkv.backends import Backend


def tool(i):
    return {"type": "function", "function": {
        "name": f"search_records_{i}", "description": "Search the records table and return matching rows as JSON.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "free-text query"},
            "limit": {"type": "integer", "description": "max rows", "minimum": 1},
            "fields": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}}}


TOOLS = [tool(i) for i in range(20)]


def react_trace(steps):
    msgs = [{"role": "system", "content": "You are a careful research agent."},
            {"role": "user", "content": "Summarise the incidents from last week.\nBe brief."}]
    for i in range(steps):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": f"search_records_{i % 20}", "arguments": json.dumps({"query": f"incident {i}"})}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        rows = [{"id": i * 100 + j, "title": f"Incident {j}", "body": "Disk latency spiked on node-7.\n" * 3} for j in range(5)]
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(rows, indent=2)})
    return msgs


def full_count(messages, tools):
    return len(encode(get_encoding(), render_chat(messages, tools)))


def test_messages_xor_prompt():
    """A payload with both messages and prompt counts the messages only."""
    msgs = [{"role": "user", "content": "hello"}]
    both = payload_from_request({"messages": msgs, "prompt": "x" * 5000})
    only = payload_from_request({"messages": msgs})
    src = TemplateSource("cl100k_base")
    assert src.count(both).total == src.count(only).total
    assert both.prompt is None


def test_prompt_only_payload():
    """A prompt-only payload counts the prompt text."""
    payload = payload_from_request({"prompt": "hello world"})
    assert TemplateSource("cl100k_base").count(payload).total == 2


def test_bad_payload_is_named():
    """A request without messages or prompt, or with a string for messages, is refused by name."""
    with pytest.raises(ValueError, match="neither"):
        payload_from_request({})
    with pytest.raises(ValueError, match="messages"):
        payload_from_request({"messages": "hi"})


def test_template_count_is_exact():
    """The template source equals a full render-and-encode of the same conversation."""
    msgs = react_trace(5)
    assert TemplateSource("cl100k_base").count(Payload(tuple(msgs), tuple(TOOLS))).total == full_count(msgs, TOOLS)


def test_incremental_equals_full_every_turn():
    """Counting turn by turn gives the same total as a full count at every turn."""
    src = TemplateSource("cl100k_base")
    msgs = react_trace(12)
    for n in range(2, len(msgs) + 1):
        assert src.count(Payload(tuple(msgs[:n]), tuple(TOOLS))).total == full_count(msgs[:n], TOOLS)


def test_appending_one_message_tokenizes_only_that_message():
    """After a long conversation is counted, appending one message encodes only the new text."""
    calls = []
    enc = get_encoding()

    def spy(text):
        calls.append(len(text))
        return encode(enc, text)

    counter = ChunkedEncoder(spy, cuts="words")
    msgs = react_trace(30)
    first = render_chat(msgs, TOOLS)
    counter.count(first)
    calls.clear()
    msgs.append({"role": "user", "content": "Now group them by node."})
    counter.count(render_chat(msgs, TOOLS))
    assert sum(calls) < 200, calls


def test_tool_schemas_are_a_large_share():
    """Twenty modest tools take most of a short conversation, and the share is reported."""
    count = TemplateSource("cl100k_base").count(Payload(({"role": "user", "content": "hi"},), tuple(TOOLS)))
    assert count.tools > 1500 and count.tools_share > 0.9


def test_approximate_source_is_close_and_safe_is_higher():
    """tiktoken-with-overheads is within 5% of exact, and its safe figure is not lower."""
    payload = Payload(tuple(react_trace(8)), tuple(TOOLS))
    exact = TemplateSource("cl100k_base").count(payload).total
    approx = TiktokenSource().count(payload)
    assert abs(approx.total - exact) / exact < 0.05
    assert approx.safe >= approx.total and not approx.exact


def test_char_estimators_have_their_stated_bias():
    """chars/4 under-estimates and chars/3 over-estimates a JSON-heavy trace."""
    payload = Payload(tuple(react_trace(8)), tuple(TOOLS))
    exact = TemplateSource("cl100k_base").count(payload).total
    chars = CharSource().count(payload)
    assert chars.total < exact < chars.safe


def test_server_source_uses_chat_form_and_caches():
    """/tokenize is asked with the chat form once per distinct payload."""
    http = FakeHttp(lambda method, url, body: {"count": 7 + len(body.get("tools", [])), "max_model_len": 4096,
                                               "tokens": list(range(7))})
    src = ServerSource(Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1"), http=http)
    payload = Payload(({"role": "user", "content": "hi"},))
    assert src.count(payload).total == 7
    assert src.count(payload).total == 7
    assert len(http.calls) == 1
    url, body = http.calls[0].url, http.calls[0].body
    assert url == "http://127.0.0.1:9/tokenize"
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


def test_counter_falls_back_when_server_fails():
    """A server without /tokenize falls back to tiktoken, and says so."""
    def refuse(method, url, body):
        raise HttpError("ConnectError from /tokenize")

    counter = TokenCounter.for_backend(Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1"), http=FakeHttp(refuse))
    count = counter.count(Payload(({"role": "user", "content": "hi"},)))
    assert count.source == "tiktoken" and not count.exact


def test_backend_with_tokenizer_counts_exactly():
    """A Backend configured with tokenizer and template counts exactly, before asking the server."""
    counter = TokenCounter.for_backend(Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", tokenizer="cl100k_base"))
    msgs = react_trace(3)
    count = counter.count(Payload(tuple(msgs), tuple(TOOLS)))
    assert count.source == "template" and count.exact and count.total == full_count(msgs, TOOLS)


def test_caller_messages_are_not_mutated():
    """Counting never changes the caller's messages."""
    msgs = react_trace(2)
    before = json.dumps(msgs)
    TemplateSource("cl100k_base").count(payload_from_request({"messages": msgs, "tools": TOOLS}))
    assert json.dumps(msgs) == before
