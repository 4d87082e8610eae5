"""Malformed message lists, each with the index and field an InvalidRequestError names (shared by the unit
tests and the real-vLLM tier, which holds that vLLM 0.32 refuses them too)."""

USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (messages, index, field) of each malformed shape
MALFORMED = {
    "no role": ([USER, {"content": "x"}], 1, "role"),
    "role not a string": ([{"role": 3, "content": "x"}], 0, "role"),
    "content a number": ([{"role": "user", "content": 5}], 0, "content"),
    "content an object": ([USER, {"role": "user", "content": {"text": "x"}}], 1, "content"),
    "user content null": ([{"role": "user", "content": None}], 0, "content"),
    "system content missing": ([{"role": "system"}, USER], 0, "content"),
    "part a number": ([{"role": "user", "content": [{"type": "text", "text": "a"}, 7]}], 0, "content[1]"),
    "part a string": ([{"role": "user", "content": ["a"]}], 0, "content[0]"),
    "part without type": ([{"role": "user", "content": [{"text": "a"}]}], 0, "content[0].type"),
    "text part without text": ([{"role": "user", "content": [{"type": "text"}]}], 0, "content[0].text"),
    "text not a string": ([{"role": "user", "content": [{"type": "image_url", "text": 1}]}], 0, "content[0].text"),
    "tool_calls an object": ([USER, {"role": "assistant", "tool_calls": {"id": "c1"}}], 1, "tool_calls"),
    "tool_calls a string": ([USER, {"role": "assistant", "tool_calls": "f()"}], 1, "tool_calls"),
    "tool call a number": ([USER, {"role": "assistant", "tool_calls": [CALL, 1]}], 1, "tool_calls[1]"),
    "tool call without function": ([USER, {"role": "assistant", "tool_calls": [{"id": "c1"}]}], 1,
                                   "tool_calls[0].function"),
    "function without name": ([USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], 1,
                              "tool_calls[0].function.name"),
    "arguments a number": ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}],
                           1, "tool_calls[0].function.arguments"),
    "tool_call_id a number": ([USER, {"role": "assistant", "tool_calls": [CALL]},
                               {"role": "tool", "tool_call_id": 1, "content": "r"}], 2, "tool_call_id"),
    "name a number": ([{"role": "user", "content": "x", "name": 1}], 0, "name"),
    "message a string": ([USER, "hello"], 1, None),
}

ABSENT_CONTENT_ACCEPTED_BY_VLLM = {"system content missing"}
"""vLLM renders a non-assistant message without a content key as empty text; agentkv refuses it as OpenAI's
API does (the built-in template cannot render a first system message without content)."""
