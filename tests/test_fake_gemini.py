"""The Gemini fake (agentkv.testing.providers.gemini) driven through litellm's real Gemini provider code over HTTP."""

import asyncio
import importlib.util
import json
import sys
import time
import types
import urllib.error
import urllib.request

import pytest

from agentkv.testing.providers.server import fake_tokens
from agentkv.testing.providers.gemini import CACHE_MIN_TOKENS, FakeGemini

MODEL = "gemini-2.5-pro"
LONG = "The agent keeps its whole working context in this system prompt so that every turn reuses it. " * 200


class Clock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def fake(clock):
    """A running fake, with litellm's process-wide memo of known cachedContents emptied around the test."""
    from litellm.llms.vertex_ai.context_caching.known_cached_contents import known_cached_contents

    known_cached_contents.clear()
    with FakeGemini(clock=clock) as server:
        yield server
    known_cached_contents.clear()


def _complete(fake, messages, **kwargs):
    import litellm

    return litellm.completion(model=f"gemini/{MODEL}", api_base=fake.url, api_key="test-key", messages=messages,
                              num_retries=0, **kwargs)


def _cached_messages(tail, text=LONG, ttl=None):
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"role": "system", "content": [{"type": "text", "text": text, "cache_control": control}]},
            {"role": "user", "content": tail}]


def _http(method, url, body=None, key="test-key"):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    if key:
        request.add_header("x-goog-api-key", key)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _stand_in_for_google_genai(monkeypatch):
    """litellm's countTokens client imports google.genai.types.FunctionResponse (needed only for functionResponse
    parts); where google-genai is not installed, a stand-in module lets the real client run."""
    try:
        import google.genai.types  # noqa: F401
        return
    except ImportError:
        pass
    stand_in = types.ModuleType("google.genai.types")
    stand_in.FunctionResponse = type("FunctionResponse", (), {})
    monkeypatch.setitem(sys.modules, "google.genai.types", stand_in)
    monkeypatch.setitem(sys.modules, "google.genai", types.ModuleType("google.genai"))
    if importlib.util.find_spec("google") is None:
        monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))


def _calls(fake, method, suffix):
    return [c for c in fake.calls if c.method == method and c.path.endswith(suffix)]


def test_plain_completion_maps_usage(fake):
    """A plain completion reaches generateContent with the key in x-goog-api-key, and usageMetadata maps onto usage."""
    response = _complete(fake, [{"role": "user", "content": "Say hello."}], max_tokens=3)
    call = fake.calls[-1]
    assert call.path == f"/v1beta/models/{MODEL}:generateContent"
    assert call.headers["x-goog-api-key"] == "test-key"
    assert response.choices[0].finish_reason == "length"  # MAX_TOKENS
    assert response.usage.completion_tokens == 3
    assert response.usage.prompt_tokens == fake.count(fake.requests[-1]) == 3 + len(fake_tokens("Say hello."))
    assert response.usage.prompt_tokens_details.cached_tokens is None


def test_cache_control_creates_then_reuses_a_cache(fake):
    """cache_control makes litellm create one cachedContents entry that later requests with a longer tail reuse."""
    first = _complete(fake, _cached_messages("First question?"))
    assert len(_calls(fake, "POST", "/cachedContents")) == 1
    (cache,) = fake.caches()
    create = _calls(fake, "POST", "/cachedContents")[0].body
    assert create["model"] == f"models/{MODEL}" and create["displayName"] == cache.display_name
    assert fake.requests[-1]["cachedContent"] == cache.name and "system_instruction" not in fake.requests[-1]
    tokens = len(cache.tokens)
    assert first.usage.prompt_tokens_details.cached_tokens == tokens
    assert first.usage.cache_creation_input_tokens == tokens  # litellm adds the creation to this call's prompt

    second = _complete(fake, _cached_messages("First question? And a much longer follow-up question, please."))
    assert len(_calls(fake, "POST", "/cachedContents")) == 1 and len(_calls(fake, "GET", "/cachedContents")) == 1
    assert fake.requests[-1]["cachedContent"] == cache.name
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.cache_read_input_tokens == tokens
    assert second.usage.prompt_tokens == fake.count(fake.requests[-1]) > tokens
    assert second.usage.cache_creation_input_tokens is None


def test_below_the_minimum_no_cache_is_created(fake):
    """A marked prefix under the model's minimum is sent inline by litellm, and the fake refuses such a cache."""
    short = "word " * 500
    response = _complete(fake, _cached_messages("hi", text=short))
    assert not _calls(fake, "POST", "/cachedContents") and not fake.caches()
    assert "cachedContent" not in fake.requests[-1] and "system_instruction" in fake.requests[-1]
    assert response.usage.prompt_tokens_details.cached_tokens is None
    status, body = _http("POST", fake.url + "/cachedContents", {
        "model": f"models/{MODEL}", "contents": [{"role": "user", "parts": [{"text": short}]}]})
    assert status == 400 and body["error"]["status"] == "INVALID_ARGUMENT"
    assert body["error"]["message"] == "Cached content is too small. total_token_count=503, min_total_token_count=2048"


def test_litellm_fails_when_the_fake_counts_fewer_than_its_estimate(fake):
    """When litellm's estimate passes the minimum but Google's count does not, the create's 400 fails the call."""
    import litellm

    with pytest.raises(litellm.BadRequestError, match="Cached content is too small"):
        _complete(fake, _cached_messages("hi", text="xqzvbnmlkjh " * 1000))  # ~8000 by litellm, 1000 words here
    assert not fake.caches()


def test_expired_cache_is_rejected_and_litellm_recreates_it(fake, clock):
    """After the TTL passes, generateContent answers 403 for the old name and litellm lists, recreates and retries."""
    _complete(fake, _cached_messages("one", ttl="600s"))
    (old,) = fake.caches()
    assert _calls(fake, "POST", "/cachedContents")[0].body["ttl"] == "600s"
    assert old.expires - old.created == 600
    clock.now += 601
    assert fake.caches() == [] and fake.expired == [old.name]
    response = _complete(fake, _cached_messages("two", ttl="600s"))
    rejected, retried = fake.requests[-2:]
    assert rejected["cachedContent"] == old.name and retried["cachedContent"] != old.name
    assert [c.method for c in fake.calls[-4:]] == ["POST", "GET", "POST", "POST"]
    assert fake.calls[-4].path.endswith(":generateContent") and fake.calls[-2].path.endswith("/cachedContents")
    assert response.usage.prompt_tokens_details.cached_tokens == len(old.tokens)
    assert fake.storage_token_hours() == pytest.approx(len(old.tokens) * 600 / 3600)


def test_count_tokens_equals_the_fake_count(fake, monkeypatch):
    """litellm.acount_tokens posts countTokens to the fake, whose answer equals fake.count and the billed prompt."""
    import litellm

    _stand_in_for_google_genai(monkeypatch)
    messages = [{"role": "user", "content": "How many tokens is this question?"}]
    result = asyncio.run(litellm.acount_tokens(model=f"gemini/{MODEL}", messages=messages, system="Be brief.",
                                               api_key="test-key", api_base=fake.root))
    (call,) = _calls(fake, "POST", ":countTokens")
    assert result.tokenizer_type != "local_tokenizer" and result.original_response["totalTokens"] == result.total_tokens
    assert "generateContentRequest" in call.body and result.total_tokens == fake.count(call.body)
    billed = _complete(fake, [{"role": "system", "content": "Be brief."}, *messages]).usage.prompt_tokens
    assert billed == result.total_tokens


def test_delete_removes_a_cache_and_litellm_recovers(fake):
    """DELETE removes a cache (GET then answers 403) and litellm's next call recreates it after the 403."""
    _complete(fake, _cached_messages("one"))
    (cache,) = fake.caches()
    assert _http("GET", f"{fake.url}/{cache.name}")[1]["name"] == cache.name
    assert _http("DELETE", f"{fake.url}/{cache.name}") == (200, {})
    assert fake.caches() == [] and fake.deleted == [cache.name]
    status, body = _http("GET", f"{fake.url}/{cache.name}")
    assert (status, body["error"]["message"]) == (403, "CachedContent not found (or permission denied)")
    _complete(fake, _cached_messages("two"))
    assert fake.requests[-2]["cachedContent"] == cache.name
    assert [c.name for c in fake.caches()] == [fake.requests[-1]["cachedContent"]]


def test_cached_content_beside_system_instruction_is_refused(fake):
    """A user-named cached_content sent beside a system message gets Google's 400, which litellm does not retry."""
    import litellm

    _complete(fake, _cached_messages("one"))
    (cache,) = fake.caches()
    with pytest.raises(litellm.BadRequestError, match="can not be used with GenerateContent request"):
        _complete(fake, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                  cached_content=cache.name)
    assert fake.requests[-1]["cachedContent"] == cache.name and "system_instruction" in fake.requests[-1]


def test_implicit_cache_hits_a_recent_shared_prefix(fake, clock):
    """A repeated long prefix within five minutes reports cached tokens without any cachedContents call."""
    prefix = [{"role": "system", "content": LONG}]
    _complete(fake, [*prefix, {"role": "user", "content": "one"}])
    hit = _complete(fake, [*prefix, {"role": "user", "content": "two"}])
    assert hit.usage.prompt_tokens_details.cached_tokens == fake.count(fake.requests[-1]) - 2  # all but "two</turn>"
    clock.now += 301
    miss = _complete(fake, [*prefix, {"role": "user", "content": "three"}])
    assert miss.usage.prompt_tokens_details.cached_tokens is None
    assert not _calls(fake, "POST", "/cachedContents")


def test_cache_resource_methods_and_errors(fake, clock):
    """Create, paged list, PATCH ttl, key scoping and missing keys answer in the documented shapes."""
    create = {"model": f"models/{MODEL}", "displayName": "docs", "systemInstruction": {"parts": [{"text": LONG}]}}
    names = [_http("POST", fake.url + "/cachedContents", create)[1]["name"] for _ in range(3)]
    first = _http("GET", fake.url + "/cachedContents?pageSize=2")[1]
    second = _http("GET", f"{fake.url}/cachedContents?pageSize=2&pageToken={first['nextPageToken']}")[1]
    assert [c["name"] for c in first["cachedContents"] + second["cachedContents"]] == names
    assert "nextPageToken" not in second and _http("GET", fake.url + "/cachedContents", key="other")[1] == {}
    patched = _http("PATCH", f"{fake.url}/{names[0]}", {"ttl": "7200s"})[1]
    (cache,) = [c for c in fake.caches() if c.name == names[0]]
    assert cache.expires == clock.now + 7200 and patched["expireTime"].endswith("Z")
    assert patched["usageMetadata"]["totalTokenCount"] == len(cache.tokens)
    status, body = _http("POST", f"{fake.url}/models/{MODEL}:generateContent", {"contents": []}, key=None)
    assert status == 403 and body["error"]["status"] == "PERMISSION_DENIED"
    assert _http("GET", f"{fake.url}/{names[1]}", key="other")[0] == 403


def test_minimums_agree_with_litellm_cost_map():
    """The fake's explicit-cache minimums are litellm's prompt_cache_min_tokens, so both refuse the same prefixes."""
    from litellm.utils import get_prompt_cache_min_tokens

    for model, minimum in CACHE_MIN_TOKENS.items():
        assert get_prompt_cache_min_tokens(f"gemini/{model}") == minimum
