"""A Session that escalates between in-process engines hands the KV prefix over through a mapper."""

import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv.handoff import CalibrationConfig, calibrate
from agentkv.handoff.offline.testing import damp_residual_writes, depth_upscaled, random_sequences, torch_threads
from agentkv.embedded.engine import LocalEngine
from agentkv.embedded.engine.models import build_model
from agentkv.embedded.server import LocalServer, engine_at
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv import Handoff
from agentkv._support.effects import run
from agentkv.warm import CooldownMap


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def source_model():
    return damp_residual_writes(build_model("tiny", seed=0), 0.25)


def serve(model, model_id, window):
    return LocalServer(LocalEngine(model, model_id=model_id, max_model_len=window))


def escalate(fast_server, slow_server, monkeypatch, **session_kwargs):
    """Drive a scripted conversation from fast to its first slow turn, warm-ahead off."""
    monkeypatch.setenv("AGENTKV_WARM_AHEAD", "0")
    fast = Backend(f"hosted_vllm/{fast_server.model_id}", api_base=fast_server.api_base, name="fast")
    slow = Backend(f"hosted_vllm/{slow_server.model_id}", api_base=slow_server.api_base, name="slow")
    agent = ScriptedAgent(result_rows=1)
    messages = agent.opening()
    with Session(fast, slow, discovery=WindowDiscovery(), cooldowns=CooldownMap(), tenant="t",
                 cache_salt_secret="k", **session_kwargs) as s:
        for _ in range(12):
            s.completion(messages=messages, tools=TOOLS[:8], max_tokens=2)
            if s.last_route.role == "slow":
                return s
            messages = messages + agent.next_turn()
    raise AssertionError("the conversation never escalated")


def test_identity_handoff_between_replicas(source_model, monkeypatch):
    """Between replicas the fast engine's cached prefix is installed in slow, which then reports it cached."""
    with serve(source_model, "rep-fast", 2048) as fast, serve(source_model, "rep-slow", 16384) as slow:
        s = escalate(fast, slow, monkeypatch, handoff="identity")
    stats = s.stats()
    assert stats["mapped_tokens"] > 1000 and stats["handoff_fallbacks"] == 0
    assert s.ledger[-1].cached_tokens >= stats["mapped_tokens"] - 16


def test_ridge_handoff_for_a_related_pair(source_model, monkeypatch, tmp_path):
    """A ridge map saved to disk, loaded by path, passes the Session's gate and maps the prefix."""
    target = depth_upscaled(source_model, order=(0, 1, 1), noise=0.05)
    mapper = calibrate(source_model, target, random_sequences(8, 64, vocab=50_000), config=CalibrationConfig(k=2))
    assert mapper.attention_cosine > 0.9  # random-weight relatives sit near 0.95; trained families sit higher
    mapper.save(tmp_path / "small-to-large")
    with serve(source_model, "src", 2048) as fast, serve(target, "tgt", 16384) as slow:
        s = escalate(fast, slow, monkeypatch, handoff="ridge", mapper=str(tmp_path / "small-to-large"),
                     min_attention_cosine=0.9)
    assert s.stats()["mapped_tokens"] > 1000 and s.stats()["handoff_fallbacks"] == 0
    assert s.ledger[-1].cached_tokens >= s.stats()["mapped_tokens"] - 16


def test_unrelated_pair_falls_back_to_replay(source_model, monkeypatch):
    """Independent models fail the quality gate: nothing is mapped, the slow engine prefills, the turn succeeds."""
    other = damp_residual_writes(build_model("tiny", seed=7), 0.25)
    mapper = calibrate(source_model, other, random_sequences(8, 64, vocab=50_000), config=CalibrationConfig(k=2))
    with serve(source_model, "a", 2048) as fast, serve(other, "b", 16384) as slow:
        s = escalate(fast, slow, monkeypatch, handoff="ridge", mapper=mapper, min_attention_cosine=0.9)
    assert s.stats()["mapped_tokens"] == 0 and s.stats()["handoff_fallbacks"] == 1
    assert s.ledger[-1].cached_tokens == 0 and s.last_route.backend == "slow"


def test_backends_outside_this_process_replay():
    """Backends that are not in-process engines cannot take KV: the handoff says so and replays."""
    handoff = Handoff("identity")
    plan = handoff.plan(Backend("hosted_vllm/a", api_base="http://127.0.0.1:9/v1"),
                        Backend("hosted_vllm/b", api_base="http://127.0.0.1:8/v1"), payload=None, cache_salt=None)
    outcome = run(handoff.execute(plan))
    assert outcome.fallback and outcome.mapped_tokens == 0 and "embedded engines" in outcome.reason


def test_running_servers_are_found_by_api_base(source_model):
    """engine_at finds a running server's engine by its api_base, and forgets it once stopped."""
    server = serve(source_model, "lookup", 2048)
    with server:
        assert engine_at(server.api_base) is server.engine and engine_at(server.base_url + "/") is server.engine
    assert engine_at(server.api_base) is None


def test_handoff_configuration_is_checked():
    """An unknown handoff backend, or ridge without a mapper, is refused with a clear message."""
    from agentkv import ConfigurationError

    with pytest.raises(ConfigurationError, match="registered"):
        Session(Backend("a"), handoff="magic")
    with pytest.raises(ConfigurationError, match="mapper="):
        Session(Backend("a"), handoff="ridge")
