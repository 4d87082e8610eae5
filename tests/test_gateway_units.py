"""The gateway's pure pieces: conversation identity, the bounded map, keys and salts, error shapes, configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentkv import ConfigurationError, derive_cache_salt
from agentkv.gateway import GatewayConfig
from agentkv.gateway.app import request_problem
from agentkv.gateway.auth import ApiKeys, bearer_token, load_api_keys, parse_api_keys, salt_secret
from agentkv.conversations import SessionMap, conversation_id, fingerprint, session_id
from agentkv.gateway.metrics import GatewayMetrics
from agentkv.gateway.replies import error_body, upstream_error_body

OPENING = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is up?"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


# ----------------------------------------------------------------------------- identity

def test_the_header_wins_then_user_then_the_fingerprint():
    """x-session-id, else `user`, else the opening's fingerprint."""
    body = {"messages": OPENING, "user": "u-7"}
    assert conversation_id(" chat-1 ", body) == "h:chat-1"
    assert conversation_id(None, body) == "u:u-7"
    assert conversation_id("", {"messages": OPENING}) == "f:" + fingerprint({"messages": OPENING})


def test_the_fingerprint_survives_later_turns_and_late_system_messages():
    """Appending turns (and a system reminder after the first user message) keeps the conversation's fingerprint."""
    later = OPENING + [{"role": "assistant", "content": "ok"}, {"role": "system", "content": "reminder"},
                       {"role": "user", "content": "next"}]
    assert fingerprint({"messages": OPENING, "tools": TOOLS}) == fingerprint({"messages": later, "tools": TOOLS})


def test_the_fingerprint_tells_openings_apart():
    """Another system prompt, first user message or tool set is another conversation."""
    base = fingerprint({"messages": OPENING, "tools": TOOLS})
    others = [{"messages": [OPENING[0], {"role": "user", "content": "other"}], "tools": TOOLS},
              {"messages": [{"role": "system", "content": "be long"}, OPENING[1]], "tools": TOOLS},
              {"messages": OPENING}]
    assert len({base, *(fingerprint(b) for b in others)}) == 4


def test_the_fingerprint_is_a_stable_sha256_the_same_in_every_process():
    """A fresh interpreter computes the same 64-hex-digit digest (no per-process hash seed)."""
    body = {"messages": OPENING, "tools": TOOLS}
    code = f"from agentkv.conversations import fingerprint; print(fingerprint({body!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == fingerprint(body) and len(other) == 64


def test_a_text_completion_is_identified_by_its_prompt_opening():
    """Prompts sharing their first 2,048 characters are one conversation; others are not."""
    head = "x" * 2048
    assert fingerprint({"prompt": head + "turn one"}) == fingerprint({"prompt": head + "turn two, longer"})
    assert fingerprint({"prompt": "a" + head}) != fingerprint({"prompt": head})


def test_session_ids_are_digests_of_the_conversation():
    """The Session id never carries a client's text, and every process derives the same one."""
    assert session_id("u:alice@example.com") == session_id("u:alice@example.com") != session_id("u:bob")
    assert "alice" not in session_id("u:alice@example.com")


# ----------------------------------------------------------------------------- the bounded map

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_map_drops_the_least_recently_used_past_its_bound():
    """With room for 2, using a then adding c drops b (not a); each drop reaches on_drop."""
    dropped = []
    sessions = SessionMap(lambda key: f"session-{key}", max_sessions=2, idle_s=60, on_drop=dropped.append)
    sessions.get("a"), sessions.get("b"), sessions.get("a"), sessions.get("c")
    assert sessions.keys() == ["a", "c"] and dropped == ["session-b"]


def test_the_map_drops_idle_entries_and_rebuilds_them():
    """An entry idle for idle_s is dropped at the next access and built anew when asked for again."""
    clock, built = Clock(), []
    sessions = SessionMap(lambda key: built.append(key) or object(), max_sessions=10, idle_s=30, clock=clock)
    first = sessions.get("a")
    clock.now = 20
    sessions.get("b")
    clock.now = 35
    sessions.get("c")
    assert sessions.keys() == ["b", "c"]
    assert sessions.get("a") is not first and built == ["a", "b", "c", "a"] and len(sessions) == 3


def test_the_map_refuses_a_useless_bound():
    """max_sessions below 1 or a non-positive idle TTL is a configuration error."""
    with pytest.raises(ConfigurationError):
        SessionMap(str, max_sessions=0, idle_s=1)
    with pytest.raises(ConfigurationError):
        SessionMap(str, max_sessions=1, idle_s=0)


# ----------------------------------------------------------------------------- keys and salts

def test_keys_map_to_tenants_by_digest_only(tmp_path):
    """The keys file's tenants are found by key; the keys themselves are not kept."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": {"tenant": "acme"}, "sk-b": {"tenant": "globex"}}))
    keys = load_api_keys(path)
    assert (keys.tenant("sk-a"), keys.tenant("sk-b"), keys.tenant("sk-c"), keys.tenant(None)) == ("acme", "globex",
                                                                                                   None, None)
    assert "sk-a" not in repr(keys)


@pytest.mark.parametrize("data", [[], {}, {"k": "acme"}, {"k": {"tenant": ""}}, {"": {"tenant": "t"}},
                                  {"k": {"name": "t"}}])
def test_malformed_keys_files_are_refused(data):
    """Anything but a non-empty {key: {"tenant": name}} object is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        parse_api_keys(data)


def test_an_unreadable_keys_file_is_refused(tmp_path):
    """A missing file or one that is not JSON is a ConfigurationError naming the path."""
    (tmp_path / "bad.json").write_text("{nope")
    for path in (tmp_path / "missing.json", tmp_path / "bad.json"):
        with pytest.raises(ConfigurationError, match=str(path.name)):
            load_api_keys(path)


def test_bearer_tokens_are_read_from_the_authorization_header():
    """`Bearer <key>` (any case) gives the key; other schemes and empty values give None."""
    assert [bearer_token(h) for h in ("Bearer sk-1", "bearer  sk-2 ", "Basic sk-3", "Bearer", "", None)] == [
        "sk-1", "sk-2", None, None, None, None]


def test_salts_derive_from_the_configured_secret_else_the_keys_file():
    """The secret is AGENTKV_CACHE_SALT_SECRET's when set; else the keys file's digest; else none (anonymous)."""
    keys = ApiKeys({}, "ab" * 32)
    assert salt_secret("s3cret", keys) == "s3cret" and salt_secret(None, None) is None
    derived = salt_secret(None, keys)
    assert derived and derived != salt_secret(None, ApiKeys({}, "cd" * 32))
    assert derive_cache_salt(derived, "acme") != derive_cache_salt(derived, "globex")


# ----------------------------------------------------------------------------- error shapes and bad input

def test_upstream_errors_are_put_in_openai_shape():
    """OpenAI-shaped errors pass as they are; vLLM's older top-level shape is nested; other text is the message."""
    current = json.dumps({"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}).encode()
    older = json.dumps({"object": "error", "message": "too long", "type": "BadRequestError", "param": None,
                        "code": 400}).encode()
    assert upstream_error_body(400, current) == current
    assert json.loads(upstream_error_body(400, older))["error"] == {"message": "too long", "type": "BadRequestError",
                                                                    "param": None, "code": 400}
    assert json.loads(upstream_error_body(503, b"<html>down</html>"))["error"]["message"] == "<html>down</html>"
    assert json.loads(upstream_error_body(500, b""))["error"]["message"] == "the backend answered HTTP 500"


def test_own_errors_have_openai_types():
    """401 is an authentication_error, 400 and 413 invalid_request_error, with the status as code."""
    assert [json.loads(error_body(s, "x"))["error"]["type"] for s in (401, 400, 413)] == [
        "authentication_error", "invalid_request_error", "invalid_request_error"]


@pytest.mark.parametrize("body, chat, problem", [
    ([], True, "JSON object"), ({"messages": {}}, True, "array"), ({"messages": [1]}, True, "object"),
    ({"messages": []}, True, None), ({"prompt": "hi"}, False, None), ({"prompt": ["a", "b"]}, False, None),
    ({"prompt": [1, 2]}, False, "prompt"), ({}, False, "prompt")])
def test_request_problems(body, chat, problem):
    """What makes a body unroutable, for chat and for text completions."""
    found = request_problem(body, chat=chat)
    assert (found is None) if problem is None else (problem in found)


# ----------------------------------------------------------------------------- configuration

def fields(**overrides):
    return {"fast_url": "http://f/v1", "fast_model": "f", "slow_url": "http://s/v1", "slow_model": "s", **overrides}


def test_limits_come_from_the_environment_and_workers_get_the_whole_config():
    """AGENTKV_GATEWAY_* set the limits; the JSON handed to workers reads back equal."""
    config = GatewayConfig(**fields()).with_env_limits({"AGENTKV_GATEWAY_MAX_BODY_BYTES": "4096",
                                                        "AGENTKV_GATEWAY_READ_TIMEOUT_S": "12.5",
                                                        "AGENTKV_GATEWAY_MAX_SESSIONS": "7"})
    assert (config.max_body_bytes, config.read_timeout_s, config.max_sessions) == (4096, 12.5, 7)
    assert GatewayConfig.from_env({"AGENTKV_GATEWAY_CONFIG": config.to_env()}) == config


@pytest.mark.parametrize("bad", [{"fast_url": "localhost:8001"}, {"slow_model": " "}, {"workers": 0},
                                 {"read_timeout_s": 0}, {"port": 70000}, {"max_body_bytes": True}])
def test_bad_configurations_are_refused(bad):
    """A URL without a scheme, an empty model, a zero limit or a bad port is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        GatewayConfig(**fields(**bad))


def test_a_non_number_limit_is_refused():
    """AGENTKV_GATEWAY_CONNECT_TIMEOUT_S=soon is a ConfigurationError naming the variable."""
    with pytest.raises(ConfigurationError, match="CONNECT_TIMEOUT"):
        GatewayConfig(**fields()).with_env_limits({"AGENTKV_GATEWAY_CONNECT_TIMEOUT_S": "soon"})


def test_warm_outcomes_below_the_threshold_are_not_counted():
    """agentkv_warms_total counts decisions past the threshold only."""
    metrics = GatewayMetrics()
    for outcome in ("below_threshold", "routed_slow", "", "fire", "cooldown", "fire"):
        metrics.warm(outcome)
    text = metrics.render().decode()
    assert 'agentkv_warms_total{outcome="fire"} 2.0' in text and 'outcome="cooldown"} 1.0' in text
    assert "below_threshold" not in text and "routed_slow" not in text


def test_importing_the_gateway_package_loads_no_server_stack():
    """`import agentkv.gateway` stays cheap: starlette, uvicorn and prometheus_client load with the app."""
    code = ("import sys, agentkv, agentkv.gateway; "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'prometheus_client') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
