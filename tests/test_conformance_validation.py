"""Bad requests get vLLM's 400 and error JSON, never a 500 that clients would retry.

Cases follow vLLM's request models (``ChatCompletionRequest`` validators, ``SamplingParams._verify_args``, the
engine's logit-bias and logprob limits, the JSON-only content type).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from pydantic import ValidationError  # noqa: E402

from agentkv.embedded.server.requests import ChatCompletionRequest  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402

MODEL = "conf-validation"
MESSAGES = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server():
    with LocalServer.from_size("tiny", window=512, model_id=MODEL, enable_prompt_tokens_details=False,
                               request_log=100) as running:
        yield running


def post(server, body, **kwargs):
    return httpx.post(server.api_base + "/chat/completions", json=body, timeout=30, **kwargs)


BAD_CHAT = {
    "seed above int64": ({"seed": 2**63}, "less_than_equal"),
    "seed below int64": ({"seed": -(2**63) - 1}, "greater_than_equal"),
    "temperature as text": ({"temperature": "hot"}, "temperature"),
    "negative temperature": ({"temperature": -1}, "temperature must be non-negative"),
    "n zero": ({"n": 0}, "n must be at least 1"),
    "top_p zero": ({"top_p": 0}, "top_p must be in (0, 1]"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens must be at least 1"),
    "min_tokens over max_tokens": ({"max_tokens": 2, "min_tokens": 5}, "min_tokens must be less than or equal"),
    "empty stop string": ({"stop": [""]}, "stop cannot contain an empty string"),
    "logit_bias out of vocabulary": ({"logit_bias": {"100353": 1.0}}, "100352"),
    "logit_bias key not an id": ({"logit_bias": {"bad1": 1, "bad2": 2}}, "bad2"),
    "logit_bias value not a number": ({"logit_bias": {"1": "x"}}, "logit_bias"),
    "stop_token_ids out of vocabulary": ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    "tool_choice without tools": ({"tool_choice": "auto"}, "`tools` must be set"),
    "tool_choice bogus": ({"tools": TOOLS, "tool_choice": "bogus"}, "tool_choice"),
    "named tool not offered": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                               "does not match any"),
    "empty tools": ({"tools": []}, "must not be an empty array"),
    "json_schema without schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                   "json_schema"),
    "json_schema missing": ({"response_format": {"type": "json_schema"}}, "'json_schema' field must be provided"),
    "two structured constraints": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "one kind"),
    "regex of the wrong type": ({"structured_outputs": {"regex": {"1": "Python"}}}, "regex"),
    "invalid regex": ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream=True"),
    "stream_options null include_usage": ({"stream_options": {"include_usage": None}}, "stream=True"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "`logprobs` must be set to true"),
    "top_logprobs over max_logprobs": ({"logprobs": True, "top_logprobs": 21}, "max allowed: 20"),
    "prompt_logprobs -1 over max_logprobs": ({"prompt_logprobs": -1}, "max allowed: 20"),
    "prompt_logprobs below -1": ({"prompt_logprobs": -2}, "positive value or -1"),
    "prompt_logprobs while streaming": ({"prompt_logprobs": 1, "stream": True}, "stream=True"),
    "continue and add_generation_prompt": ({"continue_final_message": True, "add_generation_prompt": True},
                                           "Cannot set both"),
    "empty cache_salt": ({"cache_salt": ""}, "cache_salt"),
    "empty allowed_token_ids": ({"allowed_token_ids": []}, "allowed_token_ids"),
    "allowed_token_ids out of vocabulary": ({"allowed_token_ids": [10**7]}, "out-of-vocab"),
    "message without role": ({"messages": [{"content": "hi"}]}, "role"),
    "content not text": ({"messages": [{"role": "user", "content": 5}]}, "content"),
    "text part without text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    "messages not a list": ({"messages": "hi"}, "messages"),
}


SCHEMA_FAILURES = {"seed above int64", "seed below int64", "temperature as text", "logit_bias value not a number",
                   "regex of the wrong type", "message without role", "content not text", "messages not a list"}
"""Bodies that fail the request schema itself: vLLM 0.32's validation handler answers type "Bad Request"."""


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_fields_are_400_with_vllms_error_json(server, case):
    """Each invalid field is a 400 whose error JSON names the problem; none is a 500."""
    fields, fragment = BAD_CHAT[case]
    response = post(server, {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    kind = "Bad Request" if case in SCHEMA_FAILURES else "BadRequestError"
    assert error["code"] == 400 and error["type"] == kind and fragment in error["message"]


@pytest.mark.parametrize("raw", [b"this is not json{{{", b'["not", "an", "object"]', b"42", b"null", b""])
def test_non_object_bodies_are_400(server, raw):
    """Bodies that are not a JSON object fail validation cleanly (400), as vLLM's models do."""
    response = httpx.post(server.api_base + "/chat/completions", content=raw, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == 400


def test_non_json_content_type_is_400(server):
    """vLLM accepts only application/json bodies; text/plain is refused with a 400."""
    response = httpx.post(server.api_base + "/chat/completions", timeout=30, content=b'{"messages": []}',
                          headers={"Content-Type": "text/plain"})
    assert response.status_code == 400 and "application/json" in response.json()["error"]["message"]


def test_the_openai_sdk_does_not_retry_a_bad_request(server):
    """A 400 reaches the SDK as BadRequestError after exactly one request (a 500 would have been retried)."""
    server.clear_requests()
    with openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=2) as sdk:
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, seed=2**64)
    assert len([r for r in server.requests if r.path == "/v1/chat/completions"]) == 1


def test_the_server_still_answers_after_bad_requests(server):
    """After a run of rejected requests the server serves a normal one."""
    for fields, _ in BAD_CHAT.values():
        post(server, {"model": MODEL, "messages": MESSAGES, **fields})
    assert post(server, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_null_tool_choice_means_absent():
    """An explicit null tool_choice is "auto" with tools and "none" without, as if it were left out."""
    with_tools = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, "tool_choice": None})
    without = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tool_choice": None})
    assert with_tools.tool_choice == "auto" and without.tool_choice == "none"
    so = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tool_choice": None,
                                               "structured_outputs": {"json": {"type": "object"}}})
    assert so.structured_outputs is not None


@pytest.mark.parametrize("payload", ["not json", ["a"], 42, None])
def test_request_model_rejects_non_objects(payload):
    """The request model itself raises a ValidationError (not AttributeError) for non-object input."""
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(payload)


def test_unknown_fields_are_ignored(server):
    """Extra fields, in the body or in a message, are accepted and ignored as vLLM does."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "extra_field": "0"}], "max_tokens": 2,
            "some_future_option": True}
    assert post(server, body).status_code == 200


def test_completions_validation(server):
    """/v1/completions refuses out-of-vocabulary prompt ids, an empty prompt list and a suffix with 400."""
    url = server.api_base + "/completions"
    for body in ({"prompt": [10**7]}, {"prompt": []}, {"prompt": "x", "suffix": "y"}, {"prompt": "x", "n": 0},
                 {"prompt": "x", "logprobs": 21}):
        response = httpx.post(url, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
