"""The embedded server held to real vLLM 0.32: the same requests, valid and invalid, to both, serving one checkpoint.

Each case is sent to the real fast server and to an embedded :class:`~agentkv.embedded.server.LocalServer` over the
same checkpoint and window (2048). Both must answer with the same status. An error must have the same keys and
``type``, ``param`` and message (only status, keys and type for a message failing vLLM's union of message types);
a success the same top-level, choice and ``usage`` keys, and the same prompt token count. What still differs, and
why, is listed in docs/embedded-server.md.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

WINDOW = 2048
RUN = uuid.uuid4().hex[:12]
"""In every prompt, so that no earlier run's cache shapes an answer."""


@dataclass(frozen=True)
class Case:
    """One request and what must agree between the two answers beyond status and keys."""

    name: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    stream: bool = False
    union: bool = False
    """A message failing vLLM's union of message types: it reports one error per branch and names the first
    branch in ``param``, so only status, keys and type are compared (docs/embedded-server.md)."""
    fills_window: bool = False
    """Successes: the output budget was clamped, so both must generate exactly the rest of the window and
    finish with ``"length"`` (the case sends ``ignore_eos``)."""


def text(words: str) -> str:
    return f"{RUN} {words}"


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def chat(messages: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "fast", "messages": messages, "max_tokens": 3, **fields}


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "fast", "prompt": prompt, "max_tokens": 3, **fields}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLED = [*user(text("weather in Paris?")),
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"},
                                                                  {"type": "text", "text": "21C"}]}]
PARTS = [{"type": "text", "text": text("alpha")}, {"type": "text", "text": "beta"}, {"type": "text", "text": "gamma"}]
LONG = text("word " * 3000)
"""About 3,000 tokens: over the 2048 window on its own."""
IDS = 283
"""A token id of the tier's tokenizer; prompts of ids reach exact lengths."""


def ids(n: int) -> list[int]:
    return [IDS] * n


def salted(salt: Any) -> dict[str, Any]:
    return chat(user(text("salted")), cache_salt=salt)


CASES = [
    # --- chat completions that succeed ---------------------------------------------------------------
    Case("chat", "POST", "/v1/chat/completions", chat(user(text("hello")))),
    Case("chat system and user", "POST", "/v1/chat/completions",
         chat([{"role": "system", "content": "Be brief."}, *user(text("hi"))])),
    Case("chat content list of text parts", "POST", "/v1/chat/completions", chat(user(PARTS))),
    Case("chat system content list", "POST", "/v1/chat/completions",
         chat([{"role": "system", "content": PARTS}, *user(text("hi"))])),
    Case("chat tools", "POST", "/v1/chat/completions", chat(user(text("weather?")), tools=TOOLS)),
    Case("chat tool calls and a tool result", "POST", "/v1/chat/completions", chat(CALLED, tools=TOOLS)),
    Case("chat n=2", "POST", "/v1/chat/completions", chat(user(text("two")), n=2, temperature=0.8)),
    Case("chat stop", "POST", "/v1/chat/completions", chat(user(text("stop")), stop=["\n", "."])),
    Case("chat logprobs", "POST", "/v1/chat/completions", chat(user(text("lp")), logprobs=True, top_logprobs=2)),
    Case("chat stream with usage", "POST", "/v1/chat/completions",
         chat(user(text("stream")), stream=True, stream_options={"include_usage": True}), stream=True),
    Case("chat stream", "POST", "/v1/chat/completions", chat(user(text("stream")), stream=True), stream=True),
    Case("chat salt of 128 characters", "POST", "/v1/chat/completions", salted("s" * 128)),
    Case("chat prompt plus max_tokens over the window is clamped", "POST", "/v1/chat/completions",
         chat(user(text("word " * 1880)), max_tokens=1500, ignore_eos=True, temperature=0), fills_window=True),
    # --- chat completions that are refused ------------------------------------------------------------
    Case("chat empty messages", "POST", "/v1/chat/completions", chat([])),
    Case("chat messages missing", "POST", "/v1/chat/completions", {"model": "fast", "max_tokens": 3}),
    Case("chat messages not a list", "POST", "/v1/chat/completions", chat("hello")),
    Case("chat message without role", "POST", "/v1/chat/completions", chat([{"content": "x"}]),
         union=True),
    Case("chat role not a string", "POST", "/v1/chat/completions", chat([{"role": 5, "content": "x"}]),
         union=True),
    Case("chat content not text or parts", "POST", "/v1/chat/completions", chat(user(5)),
         union=True),
    Case("chat JSON array body", "POST", "/v1/chat/completions", [{"model": "fast"}]),
    Case("chat invalid JSON", "POST", "/v1/chat/completions", raw=b'{"model": "fast", '),
    Case("chat empty body", "POST", "/v1/chat/completions", raw=b""),
    Case("chat wrong content type", "POST", "/v1/chat/completions", raw=json.dumps(chat(user("x"))).encode(),
         content_type="text/plain"),
    Case("chat max_tokens not an integer", "POST", "/v1/chat/completions", chat(user("x"), max_tokens="abc")),
    Case("chat prompt over the window", "POST", "/v1/chat/completions", chat(user(LONG))),
    Case("chat prompt text over the character bound", "POST", "/v1/chat/completions",
         chat(user(text("x" * (WINDOW * 64 + 10))))),
    Case("chat max_tokens over the window", "POST", "/v1/chat/completions", chat(user("x"), max_tokens=5000)),
    Case("chat max_completion_tokens over the window", "POST", "/v1/chat/completions",
         chat(user("x"), max_tokens=None, max_completion_tokens=5000)),
    Case("chat max_tokens zero", "POST", "/v1/chat/completions", chat(user("x"), max_tokens=0)),
    Case("chat negative temperature", "POST", "/v1/chat/completions", chat(user("x"), temperature=-1)),
    Case("chat temperature over 2", "POST", "/v1/chat/completions", chat(user("x"), temperature=3)),
    Case("chat n zero", "POST", "/v1/chat/completions", chat(user("x"), n=0)),
    Case("chat n=2 greedy", "POST", "/v1/chat/completions", chat(user("x"), n=2, temperature=0)),
    Case("chat stream_options without stream", "POST", "/v1/chat/completions",
         chat(user("x"), stream_options={"include_usage": True})),
    Case("chat top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(user("x"), top_logprobs=2)),
    Case("chat tool_choice without tools", "POST", "/v1/chat/completions", chat(user("x"), tool_choice="required")),
    Case("chat empty salt", "POST", "/v1/chat/completions", salted("")),
    Case("chat salt of 129 characters", "POST", "/v1/chat/completions", salted("s" * 129)),
    Case("chat salt with @", "POST", "/v1/chat/completions", salted("tenant@a")),
    Case("chat salt with /", "POST", "/v1/chat/completions", salted("tenant/a")),
    Case("chat salt with a backslash", "POST", "/v1/chat/completions", salted("tenant\\a")),
    Case("chat salt with NUL", "POST", "/v1/chat/completions", salted("tenant\x00a")),
    Case("chat salt not a string", "POST", "/v1/chat/completions", salted(5)),
    Case("chat unknown model", "POST", "/v1/chat/completions", {**chat(user("x")), "model": "nope"}),
    Case("chat body nested 100k deep", "POST", "/v1/chat/completions",
         raw=b'{"model": "fast", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    # --- completions ------------------------------------------------------------------------------------
    Case("completion", "POST", "/v1/completions", completion(text("hello"))),
    Case("completion of token ids", "POST", "/v1/completions", completion(ids(20))),
    Case("completion of several prompts", "POST", "/v1/completions",
         completion([text("one"), text("two")], n=2, temperature=0.8)),
    Case("completion logprobs and echo", "POST", "/v1/completions", completion(text("echo"), logprobs=2, echo=True)),
    Case("completion stream with usage", "POST", "/v1/completions",
         completion(text("stream"), stream=True, stream_options={"include_usage": True}), stream=True),
    Case("completion clamped to the window", "POST", "/v1/completions",
         completion(ids(WINDOW - 3), max_tokens=10, ignore_eos=True, temperature=0), fills_window=True),
    Case("completion prompt over the window", "POST", "/v1/completions", completion(LONG)),
    Case("completion ids one over the window", "POST", "/v1/completions", completion(ids(WINDOW + 1))),
    Case("completion ids far over the window", "POST", "/v1/completions", completion(ids(3000))),
    Case("completion ids filling the window", "POST", "/v1/completions", completion(ids(WINDOW))),
    Case("completion max_tokens over the window", "POST", "/v1/completions", completion("x", max_tokens=5000)),
    Case("completion without a prompt", "POST", "/v1/completions", {"model": "fast", "max_tokens": 3}),
    Case("completion empty prompt list", "POST", "/v1/completions", completion([])),
    Case("completion token id out of vocabulary", "POST", "/v1/completions", completion([10 ** 6])),
    Case("completion unknown model", "POST", "/v1/completions", {**completion("x"), "model": "nope"}),
    # --- tokenize, models, health ------------------------------------------------------------------------
    Case("tokenize chat", "POST", "/tokenize", {"model": "fast", "messages": user(text("count me"))}),
    Case("tokenize chat with tools", "POST", "/tokenize", {"model": "fast", "messages": user(text("w")), "tools": TOOLS}),
    Case("tokenize chat content list", "POST", "/tokenize", {"model": "fast", "messages": user(PARTS)}),
    Case("tokenize chat tool calls", "POST", "/tokenize", {"model": "fast", "messages": CALLED, "tools": TOOLS}),
    Case("tokenize prompt", "POST", "/tokenize", {"model": "fast", "prompt": text("count me")}),
    Case("tokenize empty messages", "POST", "/tokenize", {"model": "fast", "messages": []}),
    Case("tokenize neither prompt nor messages", "POST", "/tokenize", {"model": "fast"}),
    Case("models", "GET", "/v1/models"),
    Case("health", "GET", "/health"),
    Case("version", "GET", "/version"),
    Case("unknown path", "GET", "/v1/nothing-here"),
    Case("wrong method", "GET", "/v1/chat/completions"),
]


@pytest.fixture(scope="module")
def embedded(vllm_models):
    """The embedded server over the real fast server's checkpoint, same window and model id."""
    from agentkv.embedded.server import LocalServer

    with LocalServer.from_pretrained(vllm_models.fast, window=WINDOW, model_id="fast") as server:
        yield server


def send(root: str, case: Case) -> tuple[int, Any]:
    """``(status, JSON or text)``; a stream gives its parsed events, ``"[DONE]"`` included."""
    body = {k: v for k, v in case.body.items() if v is not None} if isinstance(case.body, dict) else case.body
    content = case.raw if case.raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"content-type": case.content_type} if content is not None else {}
    with httpx.Client(timeout=120) as client:
        if case.stream:
            with client.stream(case.method, root + case.path, content=content, headers=headers) as response:
                lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
                if response.status_code != 200:
                    return response.status_code, json.loads("".join(lines) or response.read())
                return response.status_code, [line if line == "[DONE]" else json.loads(line) for line in lines]
        response = client.request(case.method, root + case.path, content=content, headers=headers)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def keys(value: Any) -> list[str]:
    return sorted(value) if isinstance(value, dict) else []


def usage_shape(usage: Any) -> Any:
    """The usage object's keys, nested ones included."""
    if not isinstance(usage, dict):
        return usage
    return {k: usage_shape(v) if isinstance(v, dict) else type(v).__name__ for k, v in sorted(usage.items())}


def error_differences(case: Case, real: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    if "error" not in real:  # FastAPI's own answers ({"detail": ...}) are compared whole
        return [] if real == ours else [f"body {ours!r} != vLLM's {real!r}"]
    out = []
    mine, theirs = ours.get("error") or {}, real["error"]
    if keys(mine) != keys(theirs):
        out.append(f"error keys {keys(mine)} != vLLM's {keys(theirs)}")
    for name, wanted in (("type", True), ("param", not case.union), ("message", not case.union)):
        if wanted and mine.get(name) != theirs.get(name):
            out.append(f"error {name} {mine.get(name)!r} != vLLM's {theirs.get(name)!r}")
    return out


def stream_differences(real: list[Any], ours: list[Any]) -> list[str]:
    out = []
    if (real[-1], ours[-1]) != ("[DONE]", "[DONE]"):
        out.append("a stream must end with [DONE]")
    real, ours = real[:-1], ours[:-1]
    if keys(real[0]) != keys(ours[0]) or keys(real[0]["choices"][0]) != keys(ours[0]["choices"][0]):
        out.append(f"first chunk keys {keys(ours[0])} != vLLM's {keys(real[0])}")
    real_usage = [c["usage"] for c in real if "usage" in c]
    our_usage = [c["usage"] for c in ours if "usage" in c]
    if [usage_shape(u) for u in real_usage] != [usage_shape(u) for u in our_usage]:
        out.append(f"stream usage {our_usage} != vLLM's {real_usage}")
    elif real_usage and real_usage[-1]["prompt_tokens"] != our_usage[-1]["prompt_tokens"]:
        out.append(f"prompt tokens {our_usage[-1]['prompt_tokens']} != vLLM's {real_usage[-1]['prompt_tokens']}")
    if keys(real[-1]) != keys(ours[-1]):
        out.append(f"last chunk keys {keys(ours[-1])} != vLLM's {keys(real[-1])}")
    return out


def success_differences(case: Case, real: Any, ours: Any) -> list[str]:
    if case.stream:
        return stream_differences(real, ours)
    if not isinstance(real, dict):
        return [] if real == ours else [f"body {ours!r} != vLLM's {real!r}"]
    out = []
    if keys(real) != keys(ours):
        out.append(f"keys {keys(ours)} != vLLM's {keys(real)}")
    if "count" in real and (real["count"], real["tokens"]) != (ours.get("count"), ours.get("tokens")):
        out.append(f"/tokenize count {ours.get('count')} != vLLM's {real['count']}")
    if "choices" in real:
        mine, theirs = ours["choices"][0], real["choices"][0]
        if keys(mine) != keys(theirs) or keys(mine.get("message")) != keys(theirs.get("message")):
            out.append(f"choice keys {keys(mine)} {keys(mine.get('message'))} != vLLM's "
                       f"{keys(theirs)} {keys(theirs.get('message'))}")
        if len(real["choices"]) != len(ours["choices"]):
            out.append(f"{len(ours['choices'])} choices != vLLM's {len(real['choices'])}")
        if case.fills_window and {c["finish_reason"] for c in real["choices"] + ours["choices"]} != {"length"}:
            out.append(f"finish_reason {[c['finish_reason'] for c in ours['choices']]} (vLLM: "
                       f"{[c['finish_reason'] for c in real['choices']]}), wanted length")
    if "usage" in real:
        if usage_shape(real["usage"]) != usage_shape(ours["usage"]):
            out.append(f"usage {ours['usage']} != vLLM's {real['usage']}")
        if real["usage"]["prompt_tokens"] != ours["usage"]["prompt_tokens"]:
            out.append(f"usage.prompt_tokens {ours['usage']['prompt_tokens']} != vLLM's "
                       f"{real['usage']['prompt_tokens']}")
        if case.fills_window:
            room = WINDOW - real["usage"]["prompt_tokens"]
            got = (real["usage"]["completion_tokens"], ours["usage"]["completion_tokens"])
            if got != (room, room):
                out.append(f"completion tokens (vLLM, ours) {got}, wanted the {room} the window has left")
    if "data" in real and [m.get("max_model_len") for m in real["data"]] != [m.get("max_model_len") for m in
                                                                             ours["data"]]:
        out.append("/v1/models max_model_len differs")
    return out


def differences(case: Case, real: tuple[int, Any], ours: tuple[int, Any]) -> list[str]:
    """What the embedded server answered differently from vLLM (empty when they agree)."""
    if real[0] != ours[0]:
        return [f"status {ours[0]} != vLLM's {real[0]}: ours {str(ours[1])[:300]} / vLLM {str(real[1])[:300]}"]
    if real[0] >= 400:
        return error_differences(case, real[1], ours[1]) if isinstance(real[1], dict) else []
    return success_differences(case, real[1], ours[1])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_embedded_server_answers_as_vllm(case, vllm_fast, embedded):
    """The embedded server gives vLLM 0.32's status, error shape, usage keys and prompt count for this request."""
    real = send(vllm_fast.root, case)
    ours = send(embedded.base_url, case)
    assert differences(case, real, ours) == []


def test_the_differential_covers_enough_requests():
    """At least 36 requests, valid and invalid, are compared, two of them clamped silently to the window."""
    assert len(CASES) >= 36 and sum(c.fills_window for c in CASES) == 2


# --- KV events: the embedded publisher's frames against the real slow server's --------------------------------------


def batch_events(batch: Any) -> list[Any]:
    """A decoded batch's events, whether framed as vLLM's array or as a map."""
    return list(batch.get("events") or []) if isinstance(batch, dict) else list(batch[1])


def frames_signature(events_endpoint: str, replay_endpoint: str, send_request: Any) -> dict[str, Any]:
    """How one server frames a published batch holding a BlockStored, its replay replies and the end marker."""
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    sub.connect(events_endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    dealer.connect(replay_endpoint)
    try:
        time.sleep(0.5)  # a SUB joins late: give it time before anything is published
        send_request()
        published, batch = None, None
        while published is None and sub.poll(10_000):
            frames = sub.recv_multipart()
            decoded = msgspec.msgpack.decode(frames[2])
            if any(isinstance(e, dict) and e.get("type") == "BlockStored" for e in batch_events(decoded)):
                published, batch = frames, decoded
        assert published is not None, f"no BlockStored published on {events_endpoint}"
        dealer.send_multipart((b"", published[1]))
        replies = []
        while dealer.poll(5_000):
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
    stored = next(e for e in batch_events(batch) if e.get("type") == "BlockStored")
    return {"published": [len(published), published[0], len(published[1])],
            "batch": [type(batch).__name__, len(batch), [type(x).__name__ for x in batch]],
            "stored keys": sorted(stored),
            "replies": sorted({(len(r), r[0], r[1]) for r in replies[:-1]}),
            "replayed first": replies[0][2] == published[1] and replies[0][3] == published[2],
            "end marker": replies[-1] if replies else None}


def test_kv_event_frames_are_vllms(vllm_slow, vllm_models):
    """Published batches, replay replies (4 frames to a DEALER) and the end marker are framed as vLLM 0.32's."""
    from agentkv.embedded.server import LocalServer

    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
              "topic": "kv-events"}
    prompt = chat(user(text("events " * 300)), max_tokens=1)
    with LocalServer.from_pretrained(vllm_models.fast, window=WINDOW, model_id="fast", kv_events_config=config) as ours:
        mine = frames_signature(ours.kv_events.endpoint, ours.kv_events.replay_endpoint,
                                lambda: httpx.post(ours.api_base + "/chat/completions", json=prompt, timeout=60))
    theirs = frames_signature(vllm_slow.events_endpoint, vllm_slow.replay_endpoint,
                              lambda: httpx.post(vllm_slow.base_url + "/chat/completions", timeout=60,
                                                 json={**prompt, "model": vllm_slow.model}))
    assert theirs["end marker"] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert mine == theirs
