"""The litellm logger: plain litellm calls to the embedded servers, accounted in a Session's ledger and stats."""

import asyncio
import copy
import uuid

import pytest

from agentkv import Backend, Session
from agentkv.demo.script import TOOLS, ScriptedAgent
from conftest import chat_requests

TOOLS8 = TOOLS[:8]
_GLOBAL_LISTS = ("callbacks", "input_callback", "success_callback", "failure_callback",
                 "_async_success_callback", "_async_failure_callback", "service_callback")


@pytest.fixture
def litellm_mod():
    """litellm, with every global callback list restored after the test (litellm copies callbacks into all of them)."""
    from agentkv._support.env import import_litellm

    litellm = import_litellm()
    saved = {name: list(getattr(litellm, name)) for name in _GLOBAL_LISTS if hasattr(litellm, name)}
    yield litellm
    for name, value in saved.items():
        setattr(litellm, name, value)


@pytest.fixture
def setup(fresh, litellm_mod):
    """A Session on the embedded servers, its logger registered with litellm, and the fast model's call kwargs."""
    from agentkv.integrations.litellm import AgentKVLogger

    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    session = Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                      in_flight=fresh["in_flight"], session_id=fresh["session_id"], count_exactly=True)
    logger = AgentKVLogger(session)
    litellm_mod.callbacks = [logger]
    yield session, logger, {"model": fast.model, "api_base": fast.api_base}, litellm_mod
    assert session.drain_warms(30)


def conversation(turns):
    agent = ScriptedAgent(result_rows=1)
    msgs = agent.opening()
    for _ in range(turns):
        msgs += agent.next_turn()
    return copy.deepcopy(msgs)


def test_a_plain_completion_is_counted_and_its_cache_hits_recorded(setup):
    """Each call gets an observed ledger row with the Session's exact count; a repeat records its prefix-cache hit."""
    session, logger, fast, litellm = setup
    msgs = conversation(2)
    # a prompt no other test sent: the server is shared, and the first call must find nothing cached
    msgs[0]["content"] = f"run {uuid.uuid4().hex}\n{msgs[0]['content']}"
    for _ in range(2):
        litellm.completion(**fast, messages=msgs, tools=TOOLS8, max_tokens=2)
    assert logger.wait(finished=2), logger.counters  # success callbacks run on litellm's logging thread
    expected = session.count(messages=msgs, tools=TOOLS8)
    assert [(r.input_tokens, r.reason, r.count_source) for r in session.ledger] == [(expected.total, "observed",
                                                                                     "server")] * 2
    first, second = session.ledger
    assert first.cached_tokens == 0 and second.cached_tokens > 0.8 * expected.total
    assert session.stats()["cached_tokens_total"] == second.cached_tokens
    assert logger.counters["observed"] == 2 and logger.counters["usage_recorded"] == 2


async def test_async_calls_are_counted_through_the_async_hooks(setup):
    """litellm.acompletion is observed before it is sent and its usage recorded by async_log_success_event."""
    session, logger, fast, litellm = setup
    msgs = conversation(1)
    await litellm.acompletion(**fast, messages=msgs, max_tokens=2)
    assert await asyncio.to_thread(logger.wait, 1)
    assert session.ledger[0].input_tokens == session.count(messages=msgs).total
    assert session.ledger[0].cached_tokens is not None and logger.counters["succeeded"] == 1


def test_crossing_the_threshold_warms_slow_and_the_warm_is_not_a_turn(setup, fresh):
    """An observed call past 60% of the fast window fires one warm at slow, sent raw (not through litellm, so no turn)."""
    session, logger, fast, litellm = setup
    for turns in (1, 4):
        litellm.completion(**fast, messages=conversation(turns), tools=TOOLS8, max_tokens=2)
    assert session.drain_warms(30) and logger.wait(finished=2)
    warms = [b for b in chat_requests(fresh["slow"]) if b.get("max_tokens") == 1]
    assert len(warms) == 1 and warms[0]["messages"] == conversation(4)
    assert [r.warm for r in session.ledger] == ["below_threshold", "fire"] and logger.counters["ignored"] == 0


def test_calls_to_other_models_or_sessions_are_ignored(setup, fresh):
    """Calls to another backend, or tagged for another Session, leave the ledger alone."""
    session, logger, fast, litellm = setup
    msgs = conversation(0)
    litellm.completion(model=f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base,
                       messages=msgs, max_tokens=2)
    litellm.completion(**fast, messages=msgs, max_tokens=2, metadata={"agentkv_session": "someone-else"})
    litellm.completion(**fast, messages=msgs, max_tokens=2, metadata={"agentkv_session": session.session_id})
    assert logger.wait(finished=1)
    assert len(session.ledger) == 1 and logger.counters["ignored"] == 2


def test_overflow_failures_are_recognised(setup):
    """A call the fast server rejects as too long is counted as failed and as an overflow."""
    session, logger, fast, litellm = setup
    with pytest.raises(Exception, match="maximum context length"):
        litellm.completion(**fast, messages=conversation(14), tools=TOOLS8, max_tokens=2)
    assert logger.wait(finished=1)
    assert logger.counters["failed"] == 1 and logger.counters["overflow_errors"] == 1
    assert session.ledger[0].input_tokens > 2048 and session.ledger[0].cached_tokens is None


def test_a_hook_error_never_breaks_the_call(setup):
    """When the Session cannot observe (it is closed), the call still succeeds and the hook error is counted."""
    session, logger, fast, litellm = setup
    session.close()
    response = litellm.completion(**fast, messages=conversation(0), max_tokens=2)
    assert response.choices and logger.counters["hook_errors"] == 1 and session.ledger == []
