"""Test-wide setup: no network, offline tokenizers, quiet logs."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The deployment secret per-tenant cache salts derive from (a tenant on a self-hosted backend needs one).
os.environ.setdefault("AGENTKV_CACHE_SALT_SECRET", "agentkv-test-suite")

import uuid

import pytest


@pytest.fixture(autouse=True)
def fresh_estimate_bounds(monkeypatch):
    """No estimate bound learned when a test starts (agentkv.tokens.bound keeps one per server and model per
    process, taught by every answer's usage): one test's fake usage figures never widen another's."""
    monkeypatch.setattr("agentkv.tokens.bound._SHARED", {})


@pytest.fixture(autouse=True)
def fresh_count_breakers():
    """No /tokenize breaker open when a test starts (agentkv.tokens.breaker keeps one per URL per process): a
    test that really fails to reach 127.0.0.1:9 never leaves the next test's fake source refused."""
    from agentkv._support import defaults as _defaults

    with _defaults._LOCK:
        for key in [k for k in _defaults._INSTANCES if isinstance(k, tuple) and k[:1] == ("count_source_breaker",)]:
            del _defaults._INSTANCES[key]


@pytest.fixture(scope="session")
def servers():
    """Two embedded vLLM-compatible servers (tiny models): fast with a 2048 window, slow with 16384."""
    from agentkv.embedded.server import LocalServer

    fast = LocalServer.from_size("tiny", window=2048, model_id="fast-tiny", request_log=10_000)
    slow = LocalServer.from_size("tiny", window=16384, model_id="slow-tiny", seed=1, request_log=10_000)
    with fast, slow:
        yield fast, slow


@pytest.fixture
def fresh(servers):
    """The servers with empty request logs and fresh discovery/cooldown state for one test."""
    from agentkv import WindowDiscovery
    from agentkv.warm import CooldownMap, InFlightLimit

    fast, slow = servers
    fast.max_model_len, slow.max_model_len = 2048, 16384
    for server in servers:
        server.clear_requests()
    return {
        "fast": fast, "slow": slow, "discovery": WindowDiscovery(), "cooldowns": CooldownMap(),
        "in_flight": InFlightLimit(4), "session_id": f"test-{uuid.uuid4()}",
    }


def chat_requests(server):
    """Bodies of the chat-completion requests a server received."""
    return [r.body for r in server.requests if r.path == "/v1/chat/completions"]


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on a free loopback port for the whole run; in CI (CI=true) failing to start it fails."""
    from agentkv.testing.servers import redis_server

    try:
        server = redis_server()
        url = server.__enter__()
    except RuntimeError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI needs a real redis-server: {exc}")
        pytest.skip(f"no redis-server here: {exc}")
    try:
        yield url
    finally:
        server.__exit__(None, None, None)
