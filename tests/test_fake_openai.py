"""The OpenAI fake (agentkv.testing.providers.openai) driven through litellm's real OpenAI provider code over HTTP."""

import json
import urllib.error
import urllib.request

import pytest

from agentkv.testing.providers.openai import FakeOpenAI

NEW = "gpt-5.6"  # breakpoint caching, cache writes billed at 1.25x (litellm's cost map has both prices)
OLD = "gpt-5.1"  # 128-token-block caching, writes free
SENTENCE = "The agent keeps its whole working context in this system prompt so that every turn reuses it. "
LONG = SENTENCE * 110  # 1980 fake tokens


class Clock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def fake(clock):
    with FakeOpenAI(clock=clock) as server:
        yield server


def _complete(fake, model, messages, **kwargs):
    import litellm

    return litellm.completion(model=f"openai/{model}", api_base=fake.url + "/v1", api_key="sk-test",
                              messages=messages, num_retries=0, **kwargs)


def _details(response):
    details = response.usage.prompt_tokens_details
    return details.cached_tokens, details.cache_write_tokens


def _turns(*users, system=LONG):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(users):
        messages += [{"role": "user", "content": text}] + ([{"role": "assistant", "content": f"answer {i}"}]
                                                           if i < len(users) - 1 else [])
    return messages


def _keys_on_two_machines(fake, model, messages):
    by_machine = {}
    for i in range(64):
        by_machine.setdefault(fake.machine_for({"model": model, "messages": messages, "prompt_cache_key": f"k{i}"}),
                              f"k{i}")
    return list(by_machine.values())[:2]


def _http(fake, method, path, body=None, key="sk-test"):
    request = urllib.request.Request(fake.url + path, method=method, data=None if body is None else
                                     json.dumps(body).encode(), headers={"authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_old_model_writes_then_reads_in_128_token_blocks(fake):
    """Before GPT-5.6 a 2K-token request writes its prefix in 128-token blocks and a longer one with the same key reads it."""
    first = _complete(fake, OLD, _turns("What is in the context?"), prompt_cache_key="agent-1")
    written = first.usage.prompt_tokens - (first.usage.prompt_tokens - 1024) % 128
    assert _details(first) == (0, written) and first.usage.prompt_tokens >= 1900
    second = _complete(fake, OLD, _turns("What is in the context?", "And then?"), prompt_cache_key="agent-1")
    cached, wrote = _details(second)
    assert cached >= written and (cached - 1024) % 128 == 0 and cached <= first.usage.prompt_tokens
    assert wrote == second.usage.prompt_tokens - (second.usage.prompt_tokens - 1024) % 128 - cached


def test_new_model_reads_the_previous_turn_exactly_and_bills_writes(fake):
    """On GPT-5.6 a turn reads the previous turn's implicit breakpoint exactly, and litellm bills the writes at 1.25x."""
    import litellm

    first = _complete(fake, NEW, _turns("What is in the context?"), prompt_cache_key="agent-1")
    end_of_user = first.usage.prompt_tokens - 2  # the breakpoint ends the user message, before "<|start|> assistant"
    assert _details(first) == (0, end_of_user)
    second = _complete(fake, NEW, _turns("What is in the context?", "And then?"), prompt_cache_key="agent-1")
    assert _details(second) == (end_of_user, second.usage.prompt_tokens - 2 - end_of_user)
    price = litellm.model_cost[NEW]
    usage = second.usage
    expected = (usage.prompt_tokens_details.cached_tokens * price["cache_read_input_token_cost"]
                + usage.prompt_tokens_details.cache_write_tokens * price["cache_creation_input_token_cost"]
                + (usage.prompt_tokens - sum(_details(second))) * price["input_cost_per_token"]
                + usage.completion_tokens * price["output_cost_per_token"])
    assert litellm.completion_cost(second) == pytest.approx(expected)
    assert price["cache_creation_input_token_cost"] == pytest.approx(1.25 * price["input_cost_per_token"])


def test_new_model_misses_a_stable_prefix_unless_a_breakpoint_marks_it(fake):
    """On GPT-5.6 a changed last message misses the unchanged system prompt, unless an explicit breakpoint ends it."""
    _complete(fake, NEW, _turns("first question"), prompt_cache_key="k")
    assert _details(_complete(fake, NEW, _turns("second question"), prompt_cache_key="k"))[0] == 0
    marked = [{"type": "text", "text": LONG, "prompt_cache_breakpoint": {"mode": "explicit"}}]
    first = _complete(fake, NEW, _turns("third question", system=marked), prompt_cache_key="k")
    assert fake.requests[-1]["messages"][0]["content"][0]["prompt_cache_breakpoint"] == {"mode": "explicit"}
    second = _complete(fake, NEW, _turns("fourth question", system=marked), prompt_cache_key="k")
    block_end = 2 + 1980  # "<|start|> system", then the marked text block
    assert _details(first)[0] == 0 and _details(second)[0] == block_end


def test_below_minimum_nothing_is_cached(fake):
    """A prompt under 1024 tokens neither writes nor reads, on either family."""
    for model in (OLD, NEW):
        for _ in range(2):
            response = _complete(fake, model, _turns("short", system=SENTENCE * 50), prompt_cache_key="k")
            assert response.usage.prompt_tokens < 1024 and _details(response) == (0, 0)
    assert fake.entries() == []


def test_a_different_prompt_cache_key_can_land_on_another_machine_and_miss(fake):
    """Keys that route to different machines miss each other's cache; the warm key still hits its own."""
    messages = _turns("What is in the context?")
    key_a, key_b = _keys_on_two_machines(fake, NEW, messages)
    _complete(fake, NEW, messages, prompt_cache_key=key_a)
    assert _details(_complete(fake, NEW, messages, prompt_cache_key=key_b))[0] == 0
    assert _details(_complete(fake, NEW, messages, prompt_cache_key=key_a))[0] > 0
    assert fake.served[0].machine == fake.served[2].machine != fake.served[1].machine
    assert {entry.machine for entry in fake.entries()} == {fake.served[0].machine, fake.served[1].machine}


def test_prompt_cache_key_and_retention_pass_through_litellm_as_kwargs(fake):
    """litellm sends prompt_cache_key and prompt_cache_retention from plain kwargs, and prompt_cache_options from extra_body."""
    _complete(fake, NEW, _turns("hi"), prompt_cache_key="agent-7", prompt_cache_retention="24h",
              extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})
    body = fake.requests[-1]
    assert (body["prompt_cache_key"], body["prompt_cache_retention"]) == ("agent-7", "24h")
    assert body["prompt_cache_options"] == {"mode": "implicit", "ttl": "30m"} and "extra_body" not in body


def test_unknown_arguments_are_refused_through_litellm(fake):
    """cache_salt (a vLLM argument) and a chat prewarm are refused with OpenAI's 400s, raised by litellm as BadRequestError."""
    import litellm

    with pytest.raises(litellm.BadRequestError, match="Unrecognized request argument supplied: cache_salt"):
        _complete(fake, NEW, _turns("hi"), extra_body={"cache_salt": "tenant-1"})
    with pytest.raises(litellm.BadRequestError, match="prompt_cache_options.prewarm"):
        _complete(fake, NEW, _turns("hi"), extra_body={"prompt_cache_options": {"prewarm": True}})
    with pytest.raises(litellm.BadRequestError, match="does not support 'in_memory'"):
        _complete(fake, NEW, _turns("hi"), prompt_cache_retention="in_memory")


def test_entries_expire_when_idle(fake, clock):
    """An in-memory entry lives 10 idle minutes (a hit refreshes it), a 24h one a day, a GPT-5.6 one its 30m ttl."""
    ask, daily = _turns("What is in the context?"), _turns("What is in the context?", system="Daily. " + LONG)
    _complete(fake, OLD, ask, prompt_cache_key="mem", prompt_cache_retention="in_memory")
    _complete(fake, OLD, daily, prompt_cache_key="day", prompt_cache_retention="24h")
    _complete(fake, NEW, ask, prompt_cache_key="new")
    clock.now += 500
    assert _details(_complete(fake, OLD, ask, prompt_cache_key="mem", prompt_cache_retention="in_memory"))[0] > 0
    clock.now += 500
    assert _details(_complete(fake, OLD, ask, prompt_cache_key="mem", prompt_cache_retention="in_memory"))[0] > 0
    assert _details(_complete(fake, NEW, ask, prompt_cache_key="new"))[0] > 0
    clock.now += 601
    assert _details(_complete(fake, OLD, ask, prompt_cache_key="mem", prompt_cache_retention="in_memory"))[0] == 0
    clock.now += 1800
    assert _details(_complete(fake, NEW, ask, prompt_cache_key="new"))[0] == 0
    assert _details(_complete(fake, OLD, daily, prompt_cache_key="day", prompt_cache_retention="24h"))[0] > 0


def test_prewarm_through_the_responses_api_caches_without_generating(fake):
    """A Responses prewarm writes the prompt without output, and the next chat turn reads it."""
    import litellm

    warm = litellm.responses(model=f"openai/{NEW}", api_base=fake.url + "/v1", api_key="sk-test", num_retries=0,
                             input=[{"role": "system", "content": LONG}, {"role": "user", "content": "q"}],
                             prompt_cache_key="agent-1", prompt_cache_options={"prewarm": True})
    assert warm.output == [] and warm.usage.output_tokens == 0
    assert warm.usage.input_tokens_details.cache_write_tokens == warm.usage.input_tokens - 2
    turn = _complete(fake, NEW, _turns("q", "next"), prompt_cache_key="agent-1")
    assert _details(turn)[0] == warm.usage.input_tokens - 2


def test_max_tokens_becomes_max_completion_tokens_and_the_budget_ends_the_answer(fake):
    """litellm maps max_tokens to max_completion_tokens for gpt-5 models; a one-token budget ends with "length"."""
    response = _complete(fake, NEW, _turns("hi"), max_tokens=1)
    assert fake.requests[-1]["max_completion_tokens"] == 1 and "max_tokens" not in fake.requests[-1]
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 1
    status, body = _http(fake, "POST", "/v1/chat/completions",
                         {"model": NEW, "messages": _turns("hi"), "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "unsupported_parameter"


def test_count_matches_usage_and_tools_come_first(fake):
    """count() equals the answered prompt_tokens, and a changed tool changes the prefix from the start."""
    tool = {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {}}}
    other = {"type": "function", "function": {"name": "write", "description": "Write a file.", "parameters": {}}}
    messages = _turns("What is in the context?")
    first = _complete(fake, NEW, messages, tools=[tool], prompt_cache_key="k")
    assert first.usage.prompt_tokens == fake.count(fake.requests[-1])
    assert _details(_complete(fake, NEW, messages, tools=[other], prompt_cache_key="k"))[0] == 0


def test_context_window_and_models_and_auth(clock):
    """Over the window is litellm's ContextWindowExceededError, /v1/models lists ids only, a wrong key is a 401."""
    import litellm

    with FakeOpenAI(clock=clock, context_windows={NEW: 1500}) as fake:
        with pytest.raises(litellm.ContextWindowExceededError):
            _complete(fake, NEW, _turns("hi"))
        status, models = _http(fake, "GET", "/v1/models")
        assert status == 200 and models == {"object": "list", "data": [
            {"id": NEW, "object": "model", "created": 1_700_000_000, "owned_by": "system"}]}
        assert _http(fake, "GET", "/v1/models", key="sk-wrong")[0] == 401


def test_more_than_15_requests_a_minute_spill_to_another_machine(fake, clock):
    """The 16th request a minute on one key and prefix is served by another machine and misses."""
    body = {"model": NEW, "messages": _turns("What is in the context?"), "prompt_cache_key": "hot"}
    answers = [_http(fake, "POST", "/v1/chat/completions", body)[1] for _ in range(16)]
    assert len({served.machine for served in fake.served[:15]}) == 1
    assert fake.served[15].machine != fake.served[0].machine
    assert answers[15]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    clock.now += 61
    assert _http(fake, "POST", "/v1/chat/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_explicit_mode_writes_only_marked_blocks_and_a_12h_mark_outlives_30_minutes(fake, clock):
    """With prompt_cache_options.mode "explicit" only marked blocks are written, and a 12h mark outlives the 30m default."""
    explicit = {"prompt_cache_options": {"mode": "explicit"}}
    assert _details(_complete(fake, NEW, _turns("q"), prompt_cache_key="k", extra_body=explicit)) == (0, 0)
    marked = [{"type": "text", "text": LONG, "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]
    first = _complete(fake, NEW, _turns("q", system=marked), prompt_cache_key="k", extra_body=explicit)
    assert _details(first) == (0, 2 + 1980)
    clock.now += 7200
    assert _details(_complete(fake, NEW, _turns("other", system=marked), prompt_cache_key="k"))[0] == 2 + 1980
