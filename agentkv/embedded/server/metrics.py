"""``GET /metrics``: vLLM's metric families, names and labels, through prometheus_client.

Counters and gauges are read from the engine at scrape time (so ``num_requests_running``,
``num_requests_waiting`` and ``kv_cache_usage_perc`` are 0 whenever the engine is idle); histograms are fed by
the engine's per-request :class:`~agentkv.embedded.engine.scheduler.RequestTrace`. Every sample is labelled with
``model_name`` and ``engine`` as vLLM labels them; prefix-cache counters count tokens.

Usage::

    metrics = ServerMetrics(engine, lambda: server.model_id)     # subscribes to the engine's traces
    metrics.observe_params(n=1, max_tokens=16)
    text = metrics.render()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from agentkv.embedded.engine.scheduler import RequestTrace

if TYPE_CHECKING:
    from agentkv.embedded.engine import LocalEngine

FINISH_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def _tokens_buckets(limit: int) -> list[float]:
    """vLLM's 1-2-5 series up to ``limit`` (its ``build_1_2_5_buckets``)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return [float(v) for v in out]
            out.append(value)
        exponent += 1


class ServerMetrics:
    """One server's registry: engine counters and gauges, and vLLM's request histograms."""

    def __init__(self, engine: LocalEngine, model_name: Callable[[], str]) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.engine, self.model_name = engine, model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        tokens = _tokens_buckets(max(engine.max_model_len, 16))

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LATENCY)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _REQUEST_LATENCY)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", _REQUEST_LATENCY)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", tokens)
        self.max_generation = histogram("vllm:request_max_num_generation_tokens",
                                        "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  [1, 2, 5, 10, 20])
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.iteration = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        engine.observers.append(self.observe)

    def close(self) -> None:
        """Stop listening to the engine (the server stopped)."""
        if self.observe in self.engine.observers:
            self.engine.observers.remove(self.observe)

    def _labels(self) -> dict[str, str]:
        return {"model_name": self.model_name(), "engine": "0"}

    def observe_params(self, n: int, max_tokens: int) -> None:
        """One request's ``n`` and ``max_tokens`` (vLLM records them per request, not per sequence)."""
        labels = self._labels()
        self.params_n.labels(**labels).observe(n)
        self.params_max_tokens.labels(**labels).observe(max_tokens)

    def observe(self, trace: RequestTrace) -> None:
        """A finished sequence's timings and token counts."""
        if trace.scheduled is None:
            return
        labels = self._labels()
        times = trace.token_times
        self.queue.labels(**labels).observe(trace.scheduled - trace.arrival)
        self.e2e.labels(**labels).observe(trace.finished - trace.arrival)
        self.inference.labels(**labels).observe(trace.finished - trace.scheduled)
        self.prompt_tokens.labels(**labels).observe(trace.prompt_tokens)
        self.generation_tokens.labels(**labels).observe(len(times))
        self.max_generation.labels(**labels).observe(trace.max_tokens)
        if not times:
            return
        self.ttft.labels(**labels).observe(times[0] - trace.arrival)
        self.prefill.labels(**labels).observe(times[0] - trace.scheduled)
        self.decode.labels(**labels).observe(times[-1] - times[0])
        self.iteration.labels(**labels).observe(trace.prompt_tokens + 1)
        for before, after in zip(times, times[1:]):
            self.itl.labels(**labels).observe(after - before)
            self.iteration.labels(**labels).observe(1)

    def render(self) -> str:
        """The exposition text."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class _EngineCollector:
    """Counters and gauges read from the engine's stats at scrape time."""

    def __init__(self, engine: LocalEngine, model_name: Callable[[], str]) -> None:
        self.engine, self.model_name = engine, model_name

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.engine.stats()
        values = [self.model_name(), "0"]

        def family(kind: type, name: str, doc: str, value: float, extra: dict[str, str] | None = None) -> Any:
            metric = kind(name, doc, labels=[*LABELS, *(extra or {})])
            metric.add_metric([*values, *(extra or {}).values()], value)
            return metric

        usage = stats.running_kv_bytes / stats.cache_budget_bytes if stats.cache_budget_bytes else 0.0
        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Number of requests in model execution batches.", stats.running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     stats.waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     min(1.0, usage))
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits",
                     "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits)
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                     0)
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                     stats.prompt_tokens)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                     stats.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(stats.requests_finished)):
            success.add_metric([*values, reason], stats.requests_finished.get(reason, 0))
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "enable_prefix_caching", "engine",
                                         "num_gpu_blocks", "prefix_caching_hash_algo"])
        blocks = stats.cache_budget_bytes // max(1, self.engine.kv_bytes_per_token * self.engine.block_size)
        if self.engine.prefix_cache.num_blocks is not None:  # --num-gpu-blocks-override
            blocks = min(blocks, self.engine.prefix_cache.num_blocks)
        info.add_metric([str(self.engine.block_size), "auto", "True", "0", str(blocks), "sha256"], 1.0)
        yield info
