"""A fast and a slow real vLLM server shaped like the embedded ones, for the demo and the benchmarks.

:func:`real_pair` starts both from the tier's venv and checkpoints and yields :class:`RealModel` s that answer
what the demo asks of an embedded :class:`~agentkv.embedded.server.LocalServer`: ``model_id``, ``api_base``,
``kv_events`` (connect-side endpoints) and ``engine.stats()`` (read from the server's ``/metrics``).

    with real_pair(fast_window=2048, slow_window=8192, slow_events=True) as (fast, slow):
        Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base)
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

import httpx

from agentkv.vllm_launch.install import ensure_venv
from agentkv.vllm_launch.models import ensure_models
from agentkv.vllm_launch.server import VLLMServer, free_port, kv_events_config, start_all

__all__ = ["EngineCounters", "RealModel", "real_pair"]

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}\n]{0,2000}\})? ([0-9.eE+-]{1,40})$", re.M)


@dataclass(frozen=True)
class EngineCounters:
    """The engine totals the demo reads, from vLLM's Prometheus counters (finished requests only)."""

    requests_started: int
    prompt_tokens: int
    prefix_cache_hits: int


@dataclass(frozen=True)
class KVEventEndpoints:
    endpoint: str
    replay_endpoint: str | None


class _MetricsEngine:
    def __init__(self, root: str) -> None:
        self.root = root

    def stats(self) -> EngineCounters:
        text = httpx.get(self.root + "/metrics", timeout=10.0).text[: 4 << 20]
        totals: dict[str, float] = {}
        for name, value in _SAMPLE.findall(text):
            totals[name] = totals.get(name, 0.0) + float(value)
        return EngineCounters(int(totals.get("vllm:request_prompt_tokens_count", 0)),
                              int(totals.get("vllm:prompt_tokens_total", 0)),
                              int(totals.get("vllm:prefix_cache_hits_total", 0)))


@dataclass
class RealModel:
    """One running real vLLM server, as the demo sees a server."""

    server: VLLMServer
    kv_events: KVEventEndpoints | None = None

    @property
    def model_id(self) -> str:
        return self.server.model

    @property
    def api_base(self) -> str:
        return self.server.base_url

    @property
    def root(self) -> str:
        return self.server.root

    @property
    def engine(self) -> _MetricsEngine:
        return _MetricsEngine(self.server.root)


@contextlib.contextmanager
def real_pair(*, fast_window: int, slow_window: int, slow_events: bool = False,
              kv_cache_gib: int = 2) -> Iterator[tuple[RealModel, RealModel]]:
    """Start fast and slow (one core each), yield them healthy, stop both on exit."""
    python, models = ensure_venv(quiet=False), ensure_models()
    events = (free_port(), free_port()) if slow_events else None
    fast = VLLMServer(python, models.fast, window=fast_window, served_name="agentkv-vllm-fast", threads_bind="0",
                      kv_cache_gib=kv_cache_gib)
    slow = VLLMServer(python, models.slow, window=slow_window, served_name="agentkv-vllm-slow", threads_bind="1",
                      kv_cache_gib=kv_cache_gib, kv_events=kv_events_config(*events) if events else None)
    try:
        start_all(fast, slow)
        endpoints = (KVEventEndpoints(f"tcp://127.0.0.1:{events[0]}", f"tcp://127.0.0.1:{events[1]}")
                     if events else None)
        yield RealModel(fast), RealModel(slow, endpoints)
    finally:
        fast.stop()
        slow.stop()
