"""``GET /metrics``: the engine's counters in Prometheus text format, under vLLM's metric names.

Prefix-cache counters are in tokens (``vllm:prefix_cache_queries_total`` counts prompt tokens looked up,
``vllm:prefix_cache_hits_total`` those served from cache), labelled with ``model_name`` as vLLM labels them.
"""

from __future__ import annotations

from typing import Iterable

from agentkv.local.engine import EngineStats

FINISH_REASONS = ("stop", "length", "abort")


def _labels(**labels: str) -> str:
    inner = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {float(value)}" for labels, value in samples]
    return lines


def render_metrics(stats: EngineStats, model_name: str) -> str:
    """The exposition text for one served model."""
    base = {"engine": "0", "model_name": model_name}
    one = _labels(**base)
    reasons = sorted(set(FINISH_REASONS) | set(stats.requests_finished))
    running = stats.requests_started - sum(stats.requests_finished.values())
    usage = stats.cache_bytes_used / stats.cache_budget_bytes if stats.cache_budget_bytes else 0.0
    families = [
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
         [(one, stats.prefix_cache_queries)]),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
         [(one, stats.prefix_cache_hits)]),
        ("vllm:request_success_total", "counter", "Count of successfully processed requests.",
         [(_labels(**base, finished_reason=r), stats.requests_finished.get(r, 0)) for r in reasons]),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [(one, stats.prompt_tokens)]),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         [(one, stats.generation_tokens)]),
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [(one, running)]),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [(one, usage)]),
    ]
    return "\n".join(line for family in families for line in _metric(*family)) + "\n"
