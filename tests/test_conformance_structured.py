"""Structured outputs and forced tool calls are enforced by a grammar, so even a random-weight model complies.

Contracts from vLLM's docs: ``structured_outputs`` ``choice``/``regex``/``json``, ``response_format``
``json_schema``/``json_object``, ``tool_choice="required"`` (a JSON array of calls) and a named function (its
arguments), streamed as ``tool_calls`` deltas.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from agentkv.embedded.server import LocalServer  # noqa: E402

MODEL = "conf-structured"
MESSAGES = [{"role": "user", "content": "Give me an employee profile."}]
SCHEMA = {"type": "object", "properties": {"team": {"type": "string", "enum": ["infra", "ml", "web"]},
                                           "senior": {"type": "boolean"},
                                           "level": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["team", "senior", "level"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client():
    with LocalServer.from_size("tiny", window=1024, model_id=MODEL) as server, \
            openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def create(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **{"max_tokens": 60, **kwargs})


def test_choice(client):
    """structured_outputs.choice returns exactly one of the choices, sampled or greedy."""
    choices = ["Python", "Java", "C++", "Rust"]
    for temperature in (0, 1.0):
        content = create(client, temperature=temperature, extra_body={"structured_outputs": {"choice": choices}})
        assert content.choices[0].message.content in choices


def test_regex(client):
    """structured_outputs.regex output fully matches the pattern."""
    pattern = r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}"
    content = create(client, extra_body={"structured_outputs": {"regex": pattern}}).choices[0].message.content
    assert re.fullmatch(pattern, content)


def test_json_schema_response_format(client):
    """response_format json_schema yields JSON that validates against the schema, finishing with stop."""
    response = create(client, response_format={"type": "json_schema",
                                               "json_schema": {"name": "profile", "schema": SCHEMA}})
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    assert response.choices[0].finish_reason == "stop"


def test_structured_outputs_json_with_sampling(client):
    """structured_outputs.json constrains sampled (temperature 1) decoding as well as greedy."""
    response = create(client, temperature=1.0, seed=3, extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)


def test_json_object_is_a_complete_object(client):
    """response_format json_object yields a complete JSON object."""
    content = create(client, response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(content), dict)


PROFILE = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
    "work_history": {"type": "array", "items": {"type": "object", "properties": {
        "company": {"type": "string"}, "duration": {"type": "number"}, "position": {"type": "string"}},
        "required": ["company", "position"]}}},
    "required": ["name", "age", "skills", "work_history"]}


@pytest.mark.parametrize("seed", [0, 1])
def test_free_form_schema_closes_within_budget(client, seed):
    """A schema with unbounded strings and arrays still yields complete, valid JSON from a random-weight model."""
    response = create(client, max_tokens=400, temperature=1.0, seed=seed,
                      extra_body={"structured_outputs": {"json": PROFILE}})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), PROFILE)


def test_bound_schema_only_narrows():
    """bound_schema adds maxLength/maxItems/number bounds where absent and keeps the schema's own."""
    from agentkv.embedded.engine.grammar import bound_schema

    bounded = bound_schema(PROFILE)
    props = bounded["properties"]
    assert props["name"]["maxLength"] == 48 and props["skills"]["items"]["maxLength"] == 10
    assert props["skills"]["maxItems"] == 8 and props["age"]["maximum"] == 10**9
    assert bounded["required"] == PROFILE["required"] and PROFILE["properties"]["name"] == {"type": "string"}
    assert bound_schema({"type": "string", "enum": ["a"]}) == {"type": "string", "enum": ["a"]}


def test_named_function_is_called_with_valid_arguments(client):
    """A named tool_choice makes the whole output that function's arguments, valid against its schema."""
    message = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
                     ).choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_returns_tool_calls(client):
    """tool_choice="required" returns at least one call to an offered tool, finish_reason tool_calls."""
    choice = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in {"get_weather", "get_time"}
        assert isinstance(json.loads(call.function.arguments), dict)


def test_streamed_named_function_sends_tool_call_deltas(client):
    """Streaming a named function sends tool_calls deltas: id, type and name first, then argument pieces."""
    chunks = list(create(client, stream=True, tools=TOOLS,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER)


def test_streamed_required_sends_whole_calls(client):
    """Streaming tool_choice="required" sends each call as a tool_calls delta and finishes with tool_calls."""
    chunks = list(create(client, stream=True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    finish = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[-1].finish_reason == "tool_calls"
    (call,) = finish[-1].delta.tool_calls
    assert call.function.name in {"get_weather", "get_time"} and json.loads(call.function.arguments) is not None


def test_completions_honour_structured_outputs(client):
    """/v1/completions applies structured_outputs too."""
    text = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0].text
    assert text in {"yes", "no"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_cut_by_max_tokens_has_no_tool_calls(client, tool_choice):
    """A forced tool call cut off by max_tokens finishes with length, no tool_calls and empty content."""
    choice = create(client, max_completion_tokens=1, tools=TOOLS, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert not choice.message.content


def test_required_with_refs_to_defs(client):
    """Tools whose parameters use $ref into their own $defs still compile under "required" (defs hoisted)."""
    options = {"type": "object", "properties": {"metric": {"type": "boolean"}}, "required": ["metric"],
               "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"options": {"$ref": "#/$defs/Options"}}, "required": ["options"],
        "additionalProperties": False, "$defs": {"Options": options}}}}
    choice = create(client, tools=[tool], tool_choice="required", parallel_tool_calls=False).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and isinstance(json.loads(call.function.arguments)["options"], dict)
