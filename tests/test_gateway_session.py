"""The Session's public core for the gateway: a prompt-only body (a text completion) is prepared like a chat one."""

import uuid

import pytest

from agentkv import Backend, Session


def make_session(fresh):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"],
                   session_id=fresh["session_id"], tenant="acme")


def prompt(words):
    return f"{uuid.uuid4()} " + "hello " * words


def test_a_prompt_only_body_is_counted_routed_and_clamped(fresh):
    """prepare() takes {"prompt": ...}: a short prompt fits fast, a long one goes to slow, a tight budget is clamped."""
    with make_session(fresh) as s:
        short = s.prepare({"model": "any", "prompt": prompt(10), "max_tokens": 5})
        tight = s.prepare({"model": "any", "prompt": prompt(1000), "max_tokens": 1500})
        long = s.prepare({"model": "any", "prompt": prompt(3000), "max_tokens": 5})
    assert (short.decision.role, short.decision.reason, short.text) == ("fast", "fits", True)
    assert tight.decision.reason == "clamped" and tight.decision.max_tokens < 1500
    assert (long.decision.role, long.decision.reason) == ("slow", "proactive")


def test_a_prompt_only_warm_is_a_one_token_text_completion_to_slow(fresh):
    """Past 60% of fast's window a prompt-only body warms slow with the same prompt at /v1/completions."""
    text = prompt(1400)
    with make_session(fresh) as s:
        attempt = s.prepare({"model": "any", "prompt": text, "max_tokens": 5, "stream": True})
        assert s.drain_warms(30)
    warms = [r.body for r in fresh["slow"].requests if r.path == "/v1/completions"]
    assert attempt.warm == "fire" and s.stats()["warm_completed"] == 1
    assert warms == [{"model": fresh["slow"].model_id, "prompt": text, "max_tokens": 1, "cache_salt": s._parts.cache_salt}]


def test_completion_still_refuses_a_prompt_alone(fresh):
    """Session.completion (litellm's chat call) keeps refusing a prompt without messages."""
    with make_session(fresh) as s, pytest.raises(ValueError, match="text completion"):
        s.completion(prompt="hi")
