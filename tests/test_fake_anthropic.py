"""The Anthropic fake (agentkv.testing.providers.anthropic) driven by litellm's real Anthropic provider code over HTTP."""

import httpx
import pytest

from agentkv.testing.providers.anthropic import LOOKBACK_BLOCKS, FakeAnthropic
from agentkv.testing import FakeClock

MODEL = "anthropic/claude-sonnet-4-5"
KEY = "sk-ant-test"


def _words(n: int, seed: str = "w") -> str:
    """``n`` fake tokens of text (each word is one token)."""
    return " ".join(f"{seed}{i}" for i in range(n))


def _marked(text: str, ttl: str | None = None) -> list:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": text, "cache_control": control}]


def _ask(fake: FakeAnthropic, messages: list, *, key: str = KEY, max_tokens: int = 32, **kwargs):
    import litellm

    return litellm.completion(model=MODEL, api_base=fake.url, api_key=key, messages=messages, max_tokens=max_tokens,
                              **kwargs)


def _cached(system_words: int = 1200, ttl: str | None = None) -> list:
    return [{"role": "system", "content": _marked(_words(system_words, "s"), ttl)},
            {"role": "user", "content": "What is in the document?"}]


def _turns(n: int, start: int = 0) -> list:
    """``n`` alternating user/assistant messages (one block each), starting with a user message."""
    return [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} says {_words(5, f't{i}x')}"}
            for i in range(start, start + n)]


def test_system_breakpoint_writes_then_reads():
    """A long marked system prompt is written by the first request and read by the identical second one."""
    with FakeAnthropic() as fake:
        first, second = _ask(fake, _cached()), _ask(fake, _cached())
        sent = fake.requests[0]
        written = fake.count({"system": sent["system"], "messages": []})
    assert sent["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert first.usage.cache_creation_input_tokens == written > 1024
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.cache_read_input_tokens == second.usage.prompt_tokens_details.cached_tokens == written
    assert second.usage.cache_creation_input_tokens == 0
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == fake.count(sent)
    assert second.usage.prompt_tokens_details.text_tokens == fake.count(sent) - written


def test_moved_breakpoint_reads_the_earlier_prefix_through_the_lookback():
    """A breakpoint moved forward within the lookback reads the earlier entry and writes only the new blocks."""
    history = _turns(5)
    first = [{"role": "system", "content": _words(1200, "s")}, *history[:-1],
             {"role": "user", "content": _marked(history[-1]["content"])}]
    longer = [*first[:-1], history[-1], *_turns(6, 5)[:-1], {"role": "user", "content": _marked("and now?")}]
    with FakeAnthropic() as fake:
        _ask(fake, first)
        usage = _ask(fake, longer).usage
        earlier, now = fake.count(fake.requests[0]), fake.count(fake.requests[1])
    assert usage.cache_read_input_tokens == earlier
    assert usage.cache_creation_input_tokens == now - earlier
    assert usage.prompt_tokens_details.text_tokens == 0  # the mark is on the last block: nothing uncached
    assert [e.tokens for e in fake.entries()] == [earlier, now]


@pytest.mark.parametrize("distance", [LOOKBACK_BLOCKS, LOOKBACK_BLOCKS + 1])
def test_lookback_reaches_back_exactly_lookback_blocks(distance):
    """A breakpoint LOOKBACK_BLOCKS blocks after the written one still reads it; one block further misses."""
    first = [{"role": "system", "content": _words(1200, "s")}, {"role": "user", "content": _marked("first")}]
    far = [first[0], {"role": "user", "content": "first"}, *_turns(distance - 1, 1),
           {"role": "assistant", "content": _marked("far")}, {"role": "user", "content": "go on"}]
    with FakeAnthropic() as fake:
        _ask(fake, first)
        usage = _ask(fake, far).usage
        sent = fake.requests[1]
        marked, written = fake.count({**sent, "messages": sent["messages"][:-1]}), fake.count(fake.requests[0])
    read = written if distance <= LOOKBACK_BLOCKS else 0
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (read, marked - read)


def test_prefix_below_the_minimum_is_not_cached():
    """A marked prefix shorter than the model's minimum writes nothing; lowering the minimum makes it cacheable."""
    with FakeAnthropic() as fake:
        assert fake.min_cacheable("claude-sonnet-4-5") == 1024
        usage = _ask(fake, _cached(900)).usage
        assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens, fake.entries()) == (0, 0, [])
    with FakeAnthropic(min_cacheable={"claude-sonnet-4-5": 500}) as fake:
        assert _ask(fake, _cached(900)).usage.cache_creation_input_tokens == 900


def test_five_breakpoints_are_refused():
    """Five cache_control marks (one on a tool, one on the system prompt, three on messages) answer Anthropic's 400."""
    import litellm

    tool = {"type": "function", "cache_control": {"type": "ephemeral"},
            "function": {"name": "lookup", "description": "Look a word up.", "parameters": {"type": "object"}}}
    messages = [{"role": "system", "content": _marked("system")}, {"role": "user", "content": _marked("a")},
                {"role": "assistant", "content": _marked("b")}, {"role": "user", "content": _marked("c")}]
    with FakeAnthropic() as fake, pytest.raises(litellm.BadRequestError) as raised:
        _ask(fake, messages, tools=[tool])
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in str(raised.value)
    assert fake.requests[0]["tools"][0]["cache_control"] == {"type": "ephemeral"}


def test_unknown_top_level_fields_are_refused():
    """extra_body (litellm sends it as a literal field) and cache_salt are refused as extra inputs."""
    import litellm

    with FakeAnthropic() as fake:
        for extra, field in (({"extra_body": {"cache_salt": "s"}}, "extra_body"), ({"cache_salt": "s"}, "cache_salt")):
            with pytest.raises(litellm.BadRequestError, match=f"{field}: Extra inputs are not permitted"):
                _ask(fake, _cached(), **extra)
        assert fake.requests[0]["extra_body"] == {"cache_salt": "s"} and fake.requests[1]["cache_salt"] == "s"
        assert fake.entries() == []


def test_entries_expire_after_their_ttl_and_reads_refresh_it():
    """A 5-minute entry survives reads 299 s apart (each refreshes it) and is gone 301 s after the last one."""
    clock = FakeClock()
    with FakeAnthropic(clock=clock) as fake:
        written = _ask(fake, _cached()).usage.cache_creation_input_tokens
        for _ in range(2):
            clock.advance(299)
            assert _ask(fake, _cached()).usage.cache_read_input_tokens == written
        clock.advance(301)
        assert fake.entries() == []
        again = _ask(fake, _cached()).usage
    assert (again.cache_read_input_tokens, again.cache_creation_input_tokens) == (0, written)


def test_one_hour_ttl():
    """A "1h" mark is billed as a one-hour write and is still read after 59 minutes, not after 61 more."""
    clock = FakeClock()
    with FakeAnthropic(clock=clock) as fake:
        usage = _ask(fake, _cached(ttl="1h")).usage
        details = usage.prompt_tokens_details.cache_creation_token_details
        assert (details.ephemeral_1h_input_tokens, details.ephemeral_5m_input_tokens) == (
            usage.cache_creation_input_tokens, 0)
        clock.advance(59 * 60)
        assert _ask(fake, _cached(ttl="1h")).usage.cache_read_input_tokens == usage.cache_creation_input_tokens
        clock.advance(61 * 60)
        assert _ask(fake, _cached(ttl="1h")).usage.cache_read_input_tokens == 0


def test_cache_is_scoped_per_api_key():
    """Another API key (a stand-in for another workspace) does not read the entry."""
    with FakeAnthropic() as fake:
        _ask(fake, _cached())
        other = _ask(fake, _cached(), key="sk-ant-other").usage
    assert other.cache_read_input_tokens == 0 and other.cache_creation_input_tokens > 0


async def test_count_tokens_through_litellm_matches_the_bill():
    """litellm.acount_tokens against the fake's /v1/messages/count_tokens equals what /v1/messages billed."""
    import litellm

    messages = [*_cached(), *_turns(3, 1)]
    with FakeAnthropic() as fake:
        billed = _ask(fake, messages).usage.prompt_tokens
        counted = await litellm.acount_tokens(model=MODEL, messages=messages, api_key=KEY, api_base=fake.url)
        call = fake.calls[-1]
        assert counted.tokenizer_type == "anthropic_api" and not counted.error
        assert counted.total_tokens == billed == fake.count(fake.requests[0]) == fake.count(call.body)
    assert call.path == "/v1/messages/count_tokens" and "token-counting-2024-11-01" in call.headers["anthropic-beta"]


def test_prompt_over_the_window_is_too_long():
    """A prompt over the model's window answers 400 "prompt is too long", which litellm maps to its context error."""
    import litellm

    with FakeAnthropic(windows={"claude-sonnet-4-5": 1000}) as fake:
        with pytest.raises(litellm.ContextWindowExceededError, match=r"prompt is too long: \d+ tokens > 1000 maximum"):
            _ask(fake, _cached())


def test_max_tokens_bounds_the_answer_and_zero_is_refused():
    """max_tokens truncates the answer (finish_reason "length"); max_tokens=0, which litellm sends as is, is a 400."""
    import litellm

    with FakeAnthropic() as fake:
        short = _ask(fake, _cached(10), max_tokens=2)
        with pytest.raises(litellm.BadRequestError, match="max_tokens: Input should be greater than or equal to 1"):
            _ask(fake, _cached(10), max_tokens=0)
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (2, "length")
    assert fake.requests[-1]["max_tokens"] == 0


def test_headers_are_required():
    """No x-api-key answers 401 authentication_error; no anthropic-version answers 400."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with FakeAnthropic() as fake:
        unauthenticated = httpx.post(f"{fake.url}/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        unversioned = httpx.post(f"{fake.url}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert unauthenticated.status_code == 401 and unauthenticated.json()["error"]["type"] == "authentication_error"
    assert unversioned.status_code == 400 and unversioned.json()["type"] == "error"


def test_models_api_through_litellm():
    """litellm's Anthropic model discovery pages the fake's /v1/models; /v1/models/{alias} resolves a dated id."""
    from litellm.llms.anthropic.common_utils import AnthropicModelInfo

    with FakeAnthropic() as fake:
        listed = AnthropicModelInfo().get_models(api_key=KEY, api_base=fake.url)
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        page = httpx.get(f"{fake.url}/v1/models", params={"limit": 2}, headers=headers).json()
        one = httpx.get(f"{fake.url}/v1/models/claude-sonnet-4-5", headers=headers).json()
    assert listed == [f"anthropic/{m[0]}" for m in fake.models]
    assert page["has_more"] and [m["id"] for m in page["data"]] == [page["first_id"], page["last_id"]]
    assert one == {"id": "claude-sonnet-4-5-20250929", "type": "model", "display_name": "Claude Sonnet 4.5",
                   "created_at": "2025-09-29T00:00:00Z"}


def test_defaults_agree_with_litellms_catalog():
    """The fake's minimum cacheable length and window equal litellm's cost map for every Anthropic model it lists."""
    import litellm
    from litellm.utils import get_prompt_cache_min_tokens

    fake = FakeAnthropic()
    anthropic = {k: v for k, v in litellm.model_cost.items() if v.get("litellm_provider") == "anthropic"}
    assert "claude-sonnet-4-5" in anthropic
    for model, info in anthropic.items():
        if info.get("prompt_cache_min_tokens") is not None:
            assert fake.min_cacheable(model) == get_prompt_cache_min_tokens(model), model
        if info.get("max_input_tokens") is not None:
            assert fake.window(model) == info["max_input_tokens"], model
