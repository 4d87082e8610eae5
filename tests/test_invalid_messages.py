"""A malformed message is refused with an InvalidRequestError naming its index and field, before any count or
network call, on the sync and the async path; any JSON-shaped message list either counts or raises that error."""

import asyncio
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv import Backend, InvalidRequestError, Session
from agentkv._session.inputs import check_messages, tool_call_id_required
from agentkv.errors import AgentKVError
from agentkv.embedded.family.tokenizer import train_tokenizer
from agentkv.testing import FakeHttp, models_answer
from agentkv.tokens import TokenCount
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE
from agentkv.vllm_launch import CHAT_TEMPLATE
from malformed_messages import CALL, MALFORMED, USER

class Spy:
    """A completion client that records every call."""

    def __init__(self):
        self.calls = []

    def completion(self, **kwargs):
        self.calls.append(kwargs)
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {}}

    async def acompletion(self, **kwargs):
        return self.completion(**kwargs)


def session(tokenizer=None, template=None, slow=None):
    http = FakeHttp(lambda method, url, body: models_answer("m", 4096) if url.endswith("/models") else {"count": 1})
    fast = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", window=4096, tokenizer=tokenizer,
                   chat_template=template)
    return Session(fast, slow, client=Spy(), http=http, count_exactly=True), http


@pytest.fixture(scope="module")
def hf_tokenizer():
    return train_tokenizer(["the weather in Paris is sunny today. " * 20], vocab_size=300)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_named_before_any_call(case):
    """Session.count, completion and acompletion refuse the message by index and field; nothing is counted or sent."""
    messages, index, field = MALFORMED[case]
    s, http = session()
    for call in (lambda: s.count(messages=messages), lambda: s.completion(messages=messages, max_tokens=4),
                 lambda: asyncio.run(s.acompletion(messages=messages, max_tokens=4)),
                 lambda: asyncio.run(s.aroute(messages=messages))):
        with pytest.raises(InvalidRequestError) as raised:
            call()
        assert (raised.value.index, raised.value.field) == (index, field)
        assert f"messages[{index}]" in str(raised.value)
    assert http.calls == [] and s._parts.client.calls == []


def test_invalid_request_error_is_an_agentkv_value_error():
    """InvalidRequestError is both agentkv's error and a ValueError, and an empty or non-list messages is one."""
    assert issubclass(InvalidRequestError, AgentKVError) and issubclass(InvalidRequestError, ValueError)
    for messages in ([], "hi", {"role": "user"}):
        with pytest.raises(InvalidRequestError) as raised:
            session()[0].count(messages=messages)
        assert raised.value.field == "messages"


def test_tool_call_id_needed_where_a_template_reads_it():
    """A tool message without tool_call_id passes the built-in templates, not one that reads it or a cloud API."""
    reading = "{% for m in messages %}{{ m.tool_call_id }}{{ m.content }}{% endfor %}"
    assert not tool_call_id_required([], [CHATML_TOOLS_TEMPLATE, CHAT_TEMPLATE, None])
    assert tool_call_id_required([], [reading])
    assert tool_call_id_required([Backend("openai/gpt-4o")], [None])
    messages = [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}]
    assert session("cl100k_base")[0].count(messages=messages).exact
    with pytest.raises(InvalidRequestError) as raised:
        session("cl100k_base", reading)[0].count(messages=messages)
    assert (raised.value.index, raised.value.field) == (2, "tool_call_id")
    with pytest.raises(InvalidRequestError):
        session(slow=Backend("openai/gpt-4o"))[0].count(messages=messages)


def test_well_formed_shapes_pass():
    """Assistant messages without content, content parts of every text kind and object arguments are accepted."""
    check_messages([
        {"role": "system", "content": [{"type": "text", "text": "s"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "u"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r", "name": None},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ], tool_call_id_required=True)


# JSON values; well-formed messages of every role; and those with one field replaced by any JSON or dropped
JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(string.printable, max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)
TEXT = st.text(max_size=12)
PARTS = st.lists(st.builds(lambda kind, text: {"type": kind, kind if kind == "refusal" else "text": text},
                           st.sampled_from(["text", "input_text", "refusal"]), TEXT), max_size=3)
CALL_ST = st.builds(lambda name, args: {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}},
                    TEXT, TEXT | st.just('{"city":"Paris"}') | st.dictionaries(TEXT, JSON, max_size=2))
WELL_FORMED = st.one_of(
    st.builds(lambda role, content: {"role": role, "content": content},
              st.sampled_from(["system", "user", "developer", "narrator"]), TEXT | PARTS),
    st.builds(lambda content, calls: {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
              st.none() | TEXT | PARTS, st.lists(CALL_ST, max_size=2)),
    st.builds(lambda content: {"role": "tool", "tool_call_id": "c1", "content": content}, TEXT | PARTS),
)
FIELDS = ["role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"]


def _mutated(message, key, value, drop):
    changed = dict(message)
    if drop:
        changed.pop(key, None)
    else:
        changed[key] = value
    return changed


MUTATED = st.builds(_mutated, WELL_FORMED, st.sampled_from(FIELDS), JSON | PARTS | st.lists(CALL_ST | JSON, max_size=2),
                    st.booleans())
MESSAGES = st.lists(st.one_of(WELL_FORMED, WELL_FORMED, MUTATED, JSON), max_size=5) | JSON


@pytest.fixture(scope="module")
def counting_sessions(hf_tokenizer):
    """Sessions counting with the built-in template, with a transformers tokenizer and the tier's template, and with
    tiktoken estimates only."""
    return [session("cl100k_base")[0], session(hf_tokenizer, CHAT_TEMPLATE)[0],
            Session(Backend("hosted_vllm/m", window=4096, api_base="http://127.0.0.1:9/v1"), count_with_server=False)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(messages=MESSAGES)
def test_any_json_messages_count_or_are_refused(counting_sessions, messages):
    """Whatever JSON the messages are, each Session counts them or raises InvalidRequestError, nothing else."""
    for s in counting_sessions:
        try:
            assert isinstance(s.count(messages=messages), TokenCount)
        except InvalidRequestError:
            pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(messages=MESSAGES)
def test_any_json_messages_route_or_are_refused_async(counting_sessions, messages):
    """The async path holds the same: aroute decides or raises InvalidRequestError, nothing else."""
    try:
        asyncio.run(counting_sessions[1].aroute(messages=messages))
    except InvalidRequestError:
        pass
