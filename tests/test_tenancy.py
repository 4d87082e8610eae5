"""Salts: vLLM's rules checked before anything is sent, and no caller kwarg can replace a tenant's salt."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from agentkv import Backend, ConfigurationError, Session, derive_cache_salt
from agentkv._session.attempts import request_kwargs, warm_body, warm_kwargs
from agentkv.errors import InvalidRequestError
from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport
from agentkv.tenancy import cache_salt_problem, with_body_salt, with_cache_salt
from agentkv.testing import capture_events
from conftest import chat_requests

SECRET = "tenancy-test-secret"
MESSAGES = [{"role": "user", "content": "Which disk is slow on host 7?"}]
# vLLM 0.32's validate_cache_salt refuses each of these with a 400 (probed on the real server with curl).
REFUSED = ["", "a/b", "a@b", "a\\b", "a\x00b", "x" * 129, 5]
ACCEPTED = ["x" * 128, "tenant-a", "é" * 128, derive_cache_salt(SECRET, "t")]


def _session(fresh, **kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                   in_flight=fresh["in_flight"], session_id=fresh["session_id"], **kwargs)


def _sent_salts(fresh) -> list[object]:
    return [body.get("cache_salt", "<none>") for server in ("fast", "slow") for body in chat_requests(fresh[server])]


def _replacements(events) -> list[dict]:
    return [e for e in events if e["event"] == "cache_salt_replaced"]


# ----------------------------------------------------------------------------- vLLM's rules
@pytest.mark.parametrize("salt", REFUSED)
def test_a_salt_vllm_refuses_has_a_problem(salt):
    """Empty, over 128 characters, '@', '/', '\\', NUL or not a string: each is named as a problem."""
    assert cache_salt_problem(salt) is not None


@pytest.mark.parametrize("salt", ACCEPTED)
def test_a_salt_vllm_takes_has_no_problem(salt):
    """128 characters (code points, not bytes), hex and plain ids pass, as on vLLM 0.32."""
    assert cache_salt_problem(salt) is None


@pytest.mark.parametrize("salt", [s for s in REFUSED if isinstance(s, str)])
def test_an_operator_salt_vllm_refuses_is_a_configuration_error(fresh, salt):
    """Session(cache_salt=...) that vLLM would 400 on every request is refused at construction, without quoting it."""
    with pytest.raises(ConfigurationError, match="cache_salt") as refused:
        _session(fresh, cache_salt=salt)
    assert salt == "" or salt not in str(refused.value)
    assert chat_requests(fresh["fast"]) == []


def test_a_bad_caller_salt_on_a_session_without_tenant_is_refused_before_anything_is_sent(fresh):
    """With no tenant and no salt the caller's own salt goes as given, so one vLLM refuses is an InvalidRequestError first."""
    with _session(fresh) as s:
        with pytest.raises(InvalidRequestError, match=r"extra_body\.cache_salt must not contain"):
            s.completion(messages=MESSAGES, max_tokens=2, extra_body={"cache_salt": "a/b"})
        with pytest.raises(InvalidRequestError, match=r"^cache_salt must be at most 128"):
            s.completion(messages=MESSAGES, max_tokens=2, cache_salt="x" * 129)
    assert [r for r in fresh["fast"].requests] == []  # not even a /tokenize


def test_a_session_without_tenant_sends_the_callers_valid_salt_as_given(fresh):
    """A single-tenant Session has no isolation to keep: the caller's salt is the operator's, and it is sent."""
    with _session(fresh) as s, capture_events() as events:
        s.completion(messages=MESSAGES, max_tokens=2, extra_body={"cache_salt": "ops-group"})
    assert _sent_salts(fresh) == ["ops-group"] and _replacements(events) == []


# ----------------------------------------------------------------------------- no caller kwarg breaks isolation
@pytest.mark.parametrize("where", ["cache_salt", "extra_body.cache_salt", "both"])
def test_a_tenants_salt_replaces_any_caller_salt_sync(fresh, where):
    """Session(tenant="tenant-B").completion(..., cache_salt="X") reaches the server with tenant-B's salt, and a
    warning names where the caller's was, never a salt."""
    kwargs = {"cache_salt": "X"} if where == "cache_salt" else {"extra_body": {"cache_salt": "X"}}
    if where == "both":
        kwargs = {"cache_salt": "X", "extra_body": {"cache_salt": "Y"}}
    with _session(fresh, tenant="tenant-B", cache_salt_secret=SECRET) as s, capture_events() as events:
        s.completion(messages=MESSAGES, max_tokens=2, **kwargs)
    assert _sent_salts(fresh) == [derive_cache_salt(SECRET, "tenant-B")]
    [warning] = _replacements(events)
    places = ["cache_salt", "extra_body.cache_salt"] if where == "both" else [where]
    assert (warning["places"], warning["action"], warning["tenant"]) == (places, "replaced", "tenant-B")
    assert "X" not in json.dumps(warning, default=str).replace("extra_body", "")


def test_a_tenants_salt_replaces_a_caller_salt_async(fresh):
    """The async path: a top-level cache_salt kwarg is replaced by the tenant's derived salt, with the warning."""

    async def send() -> None:
        async with _session(fresh, tenant="tenant-B", cache_salt_secret=SECRET) as s:
            await s.acompletion(messages=MESSAGES, max_tokens=2, cache_salt="X")

    with capture_events() as events:
        asyncio.run(send())
    assert _sent_salts(fresh) == [derive_cache_salt(SECRET, "tenant-B")]
    assert [e["places"] for e in _replacements(events)] == [["cache_salt"]]


def test_a_caller_salt_equal_to_the_tenants_is_not_news(fresh):
    """A caller that passes the Session's own salt (as LangChain users are told to) is not warned about."""
    with _session(fresh, tenant="tenant-B", cache_salt_secret=SECRET) as s, capture_events() as events:
        s.completion(messages=MESSAGES, max_tokens=2, extra_body={"cache_salt": s._parts.cache_salt})
    assert _replacements(events) == [] and _sent_salts(fresh) == [s._parts.cache_salt]


def test_a_tenant_that_opted_out_sends_no_caller_salt(fresh):
    """cache_salt=False shares the unsalted cache knowingly; a caller's salt is removed, not let through."""
    with _session(fresh, tenant="tenant-B", cache_salt=False) as s, capture_events() as events:
        s.completion(messages=MESSAGES, max_tokens=2, cache_salt="tenant-A", extra_body={"cache_salt": "tenant-A"})
    assert _sent_salts(fresh) == ["<none>"]
    assert [(e["places"], e["action"]) for e in _replacements(events)] == [
        (["cache_salt", "extra_body.cache_salt"], "removed")]


def test_the_operators_salt_replaces_a_caller_salt(fresh):
    """The documented operator override, Session(cache_salt=...), is the salt sent; a caller's is replaced."""
    with _session(fresh, tenant="tenant-B", cache_salt="ops-tenant-b") as s:
        s.completion(messages=MESSAGES, max_tokens=2, cache_salt="X")
    assert _sent_salts(fresh) == ["ops-tenant-b"]


def test_the_openai_transport_replaces_a_salt_in_the_json_body(fresh):
    """openai.OpenAI over AgentKVTransport with extra_body={"cache_salt": "X"}: the body carries tenant-B's salt."""
    with _session(fresh, tenant="tenant-B", cache_salt_secret=SECRET) as s, capture_events() as events:
        client = openai.OpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                               http_client=httpx.Client(transport=AgentKVTransport(s)))
        client.chat.completions.create(model=fresh["fast"].model_id, messages=MESSAGES, max_tokens=2,
                                       extra_body={"cache_salt": "X"})
    assert _sent_salts(fresh) == [derive_cache_salt(SECRET, "tenant-B")]
    assert [e["places"] for e in _replacements(events)] == [["cache_salt"]]


def test_the_async_openai_transport_replaces_a_salt_in_the_json_body(fresh):
    """The async transport: the same replacement."""

    async def send() -> None:
        async with _session(fresh, tenant="tenant-B", cache_salt_secret=SECRET) as s:
            client = openai.AsyncOpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                                        http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(s)))
            await client.chat.completions.create(model=fresh["fast"].model_id, messages=MESSAGES, max_tokens=2,
                                                 extra_body={"cache_salt": "X"})

    asyncio.run(send())
    assert _sent_salts(fresh) == [derive_cache_salt(SECRET, "tenant-B")]


# ----------------------------------------------------------------------------- the request builders
SLOW = Backend("hosted_vllm/slow", api_base="http://slow/v1")
CALLER = {"messages": MESSAGES, "cache_salt": "X", "extra_body": {"cache_salt": "Y", "top_k": 5}}


def test_request_builders_carry_only_the_sessions_salt():
    """The litellm call, the litellm warm and both raw warm bodies carry the Session's salt and no caller's."""
    call = request_kwargs(SLOW, CALLER, "T", max_tokens=None)
    assert "cache_salt" not in call and call["extra_body"] == {"cache_salt": "T", "top_k": 5}
    assert warm_kwargs(SLOW, CALLER, "T", 1.0)["extra_body"]["cache_salt"] == "T"
    assert warm_body(SLOW, CALLER, "T", raw=False)["cache_salt"] == "T"
    assert warm_body(SLOW, {"messages": MESSAGES, "cache_salt": "X"}, "T", raw=True)["cache_salt"] == "T"
    assert CALLER["extra_body"]["cache_salt"] == "Y"  # the caller's dicts are untouched


def test_request_builders_remove_caller_salts_when_the_session_has_none():
    """With no salt of its own a tenant's request carries none (a salt is never taken from the caller)."""
    call = request_kwargs(SLOW, CALLER, None, max_tokens=None)
    assert "cache_salt" not in call and call["extra_body"] == {"top_k": 5}
    assert "cache_salt" not in warm_body(SLOW, CALLER, None, raw=False)
    assert "cache_salt" not in with_body_salt({"cache_salt": "X"}, None)


def test_request_builders_keep_the_callers_salt_only_when_told():
    """keep_caller (a Session with no tenant and no salt) sends the caller's salts as they are, warms included."""
    assert request_kwargs(SLOW, CALLER, None, max_tokens=None, keep_caller_salt=True)["cache_salt"] == "X"
    assert warm_kwargs(SLOW, {"messages": MESSAGES, "cache_salt": "X"}, None, 1.0,
                       keep_caller_salt=True)["cache_salt"] == "X"
    assert with_cache_salt({"extra_body": {"cache_salt": "Y"}}, None, keep_caller=True)["extra_body"] == {"cache_salt": "Y"}
