"""vLLM's prompt-token counters by source, read from ``/metrics`` text (what a handoff's caller checks).

    by_source = prompt_tokens_by_source(http.request("GET", root + "/metrics", timeout_s=5.0, text=True))
    by_source["external_kv_transfer"]      # prompt tokens whose KV a connector loaded, summed over engines
"""

from __future__ import annotations

import re

__all__ = ["EXTERNAL", "prompt_tokens_by_source"]

EXTERNAL = "external_kv_transfer"
_SAMPLE = re.compile(r'^vllm:prompt_tokens_by_source_total\{([^}\n]{0,2000})\} ([0-9.eE+-]{1,40})$', re.M)
_SOURCE = re.compile(r'(?:^|,)source="([a-z_]{1,64})"')


def prompt_tokens_by_source(text: str, model: str | None = None) -> dict[str, int]:
    """``vllm:prompt_tokens_by_source_total`` per source label (for one ``model_name`` when given)."""
    totals: dict[str, int] = {}
    for labels, value in _SAMPLE.findall(text):
        source = _SOURCE.search(labels)
        if source is None or (model is not None and f'model_name="{model}"' not in labels):
            continue
        totals[source.group(1)] = totals.get(source.group(1), 0) + int(float(value))
    return totals
