"""A declared transformers tokenizer and template render what vLLM 0.32 renders: its content format, its
conversation (content parts flattened, tool-call arguments re-rendered), its tools, and no empty conversation."""

import json

import pytest

from agentkv.embedded.family.tokenizer import train_tokenizer
from agentkv.tokens import CountUnavailable, Payload, TemplateSource
from agentkv.tokens.content_format import detect_content_format, references_field
from agentkv.tokens.conversation import vllm_conversation, vllm_tools
from agentkv.vllm_launch import CHAT_TEMPLATE

# Each template with the format vLLM 0.32's renderers.hf._detect_content_format gave it (checked in its venv).
DETECTED = {
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}": "openai",
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}": "string",
    "{% set msgs = messages %}{% for m in msgs %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endfor %}":
        "openai",
    "{% for m in messages[1:] %}{% for part in m.content | list %}{{ part.text }}{% endfor %}{% endfor %}": "openai",
    "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c.text }}{% endfor %}{% endfor %}":
        "openai",
    "{% macro render(items) %}{% for it in items %}{{ it.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(m.content) }}{% endfor %}": "openai",
    "{% macro render(x, items=none) %}{% for it in items %}{{ it.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(1, items=m['content']) }}{% endfor %}": "openai",
    "{% macro render(content) %}{% for it in content %}{{ it.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}": "string",
    "{% for i, m in messages|enumerate %}{{ m.content }}{% endfor %}": "string",
    "{% for m in messages %}{% for k, v in m.content|items %}{{ v }}{% endfor %}{% endfor %}": "string",
    "{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endgeneration %}"
    "{% endfor %}": "openai",
    "{% for m in messages %}{{ m.content }": "string",
    "{%- for message in messages %}{%- if message.content is not string %}{%- for item in message.content %}"
    "{{ item }}{%- endfor %}{%- endif %}{%- endfor %}": "openai",
    CHAT_TEMPLATE: "string",
}

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def call(arguments):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


@pytest.fixture(scope="module")
def hf_tokenizer():
    text = "the weather in Paris is sunny today. " * 20 + '{"city": "Paris"} <tool_call> </tool_call>\n' * 5
    return train_tokenizer([text], vocab_size=400)


@pytest.mark.parametrize("template", list(DETECTED), ids=range(len(DETECTED)))
def test_content_format_detected_as_vllm_does(template):
    """Each template gets the content format vLLM 0.32 detects for it."""
    assert detect_content_format(template) == DETECTED[template]


def test_references_field_reads_attributes_and_items():
    """A template reads tool_call_id when it writes message.tool_call_id or message['tool_call_id'], not otherwise."""
    assert references_field("{{ messages[0].tool_call_id }}", "tool_call_id")
    assert references_field("{{ m['tool_call_id'] }}", "tool_call_id")
    assert not references_field(CHAT_TEMPLATE, "tool_call_id")
    assert references_field("{{ m.tool_call_id ", "tool_call_id")  # unparsable: searched as text


def test_string_format_joins_text_parts_with_newlines():
    """For a "string" template, text parts (and a system list) are joined with "\\n", None content is ""."""
    messages = [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "input_text", "text": "d"},
                                             {"type": "text", "text": None}]},
                {"role": "assistant", "content": None}]
    assert [m["content"] for m in vllm_conversation(messages, "string")] == ["a\nb", "c\nd", ""]


def test_openai_format_keeps_parts_and_joins_tool_results():
    """For an "openai" template, content is a list of text parts (a string too); a tool result's are joined."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"},
                                                                   {"type": "text", "text": "y"}]}]
    conversation = vllm_conversation(messages, "openai")
    assert conversation[0]["content"] == [{"type": "text", "text": "hi"}]
    assert conversation[1] == {"role": "tool", "content": "x\ny", "tool_call_id": "c1"}


def test_tool_call_arguments_parsed_and_caller_untouched():
    """String arguments become dicts (bad or non-object JSON becomes {}), the caller's messages stay as they were."""
    messages = [call('{"city":"Paris"}'), call("not json"), call("[1]"), call("")]
    before = json.dumps(messages)
    conversation = vllm_conversation(messages, "string")
    assert [m["tool_calls"][0]["function"]["arguments"] for m in conversation] == [{"city": "Paris"}, {}, {}, {}]
    assert json.dumps(messages) == before


def test_only_vllm_fields_survive():
    """Unknown message keys are dropped, reasoning_content is carried as both names, empty tool_calls go."""
    messages = [{"role": "user", "content": "x", "extra": 1, "name": 7},
                {"role": "assistant", "content": "y", "tool_calls": [], "reasoning_content": "r"}]
    assert vllm_conversation(messages, "string") == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "reasoning": "r", "reasoning_content": "r"}]


def test_developer_becomes_one_first_system_message():
    """Without a developer role in the template, developer messages merge with the system ones into the first."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "developer", "content": "d"}]
    assert vllm_conversation(messages, "string", CHAT_TEMPLATE) == [
        {"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]
    assert vllm_conversation(messages, "string", "{{ 'developer' }}")[2]["role"] == "developer"


def test_media_parts_are_left_to_the_server():
    """An image part cannot be counted by a local rendering."""
    with pytest.raises(CountUnavailable):
        vllm_conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "string")


def test_tools_written_as_vllm_dumps_them():
    """A tool is type then function (name, description, parameters, set options), absent fields null, extras gone."""
    tools = [{"function": {"parameters": {"p": 1}, "name": "f", "x": 2}, "cache_control": {}, "type": "function"},
             {"type": "function", "defer_loading": True, "function": {"name": "g", "strict": True}}]
    assert vllm_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"p": 1}}},
        {"type": "function", "function": {"name": "g", "description": None, "parameters": None, "strict": True,
                                          "defer_loading": True}, "defer_loading": True}]
    assert vllm_tools(None) is None


def test_tools_counted_without_an_empty_conversation(hf_tokenizer):
    """A request with tools counts through a transformers tokenizer, its tool tokens the difference they make."""
    source = TemplateSource(hf_tokenizer, CHAT_TEMPLATE)
    messages = ({"role": "user", "content": "weather in Paris"},)
    with_tools = source.count(Payload(messages, (TOOL,)))
    without = source.count(Payload(messages))
    assert with_tools.exact and with_tools.tools == with_tools.total - without.total > 0


def test_content_list_counts_as_its_joined_text(hf_tokenizer):
    """Content parts count as their texts joined with "\\n", for user and system messages."""
    source = TemplateSource(hf_tokenizer, CHAT_TEMPLATE)
    parts = [{"type": "text", "text": "the weather"}, {"type": "text", "text": "in Paris"}]
    for role in ("system", "user"):
        listed = (({"role": role, "content": parts}, {"role": "user", "content": "x"}))
        joined = ({"role": role, "content": "the weather\nin Paris"}, {"role": "user", "content": "x"})
        assert source.count(Payload(listed)).total == source.count(Payload(joined)).total


def test_compact_and_spaced_arguments_count_alike(hf_tokenizer):
    """Compact and spaced argument strings render the same once parsed, as on vLLM."""
    source = TemplateSource(hf_tokenizer, CHAT_TEMPLATE)
    user = {"role": "user", "content": "weather?"}
    compact = source.render(Payload((user, call('{"city":"Paris"}')), (TOOL,)))
    spaced = source.render(Payload((user, call('{"city": "Paris"}')), (TOOL,)))
    assert compact == spaced and '"arguments": {"city": "Paris"}' in compact


def test_template_refusal_is_count_unavailable(hf_tokenizer):
    """A template that raises on the conversation makes the source unavailable, not the request fail."""
    source = TemplateSource(hf_tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(CountUnavailable):
        source.count(Payload(({"role": "user", "content": "x"},)))
