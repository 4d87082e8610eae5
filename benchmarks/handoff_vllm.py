"""Cross-model KV handoff on real vLLM servers: escalation TTFT cold (replay), mapped and warm-ahead, and quality.

Two vLLM 0.32 CPU servers run the tier's checkpoints (agentkv.vllm_launch) with AgentKVConnector: fast (2 layers)
exports, slow (4 layers) maps with a fast -> slow ridge mapper calibrated on the tier's checkpoints and loads.
For each length the same escalated request (a prefix fast has just served plus a ~100-token tail) goes to slow
three ways, side by side in one run:

- cold: slow prefills everything (replay; a fresh salt);
- mapped: fast exports the prefix (its prefix cache holds it), slow maps it on its own device and loads it
  through the CPU attention backend's writer under the handoff salt, then prefills the tail;
- warm-ahead: slow prefilled the prefix earlier under the tenant's salt (a warm), and prefills only the tail.

TTFT is the wall time of a one-token request (the prefill and the first token). The export (client wall time of fast's
one-token export request) and slow's read/map/load times (from its connector's log line) are shown separately.

Quality, against the slow model's own prefill on held-out text (the calibration's held-out split, transformers):
attention-output cosine, greedy agreement and KL for identity and for the tier's fast -> slow mapper, with the
gate's decision at its default floor; and as served: the mapped answer's first token against the cold one's
(equal or not, and KL over the cold answer's top-5 logprobs).
(The tier's checkpoints have random weights: the mapper's figures are low and the gate says replay, as it
should; a trained family's mapper is read with --mapper DIR.)

    python benchmarks/handoff_vllm.py [--lengths 2048,4096,8192] [--repeats 3] [--json]
    python benchmarks/handoff_vllm.py --gpu-script > gpu_handoff.py   # the prepared one-GPU script (see docs)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

BLOCK = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192", help="prefix tokens (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length and way (median)")
    parser.add_argument("--mapper", default=None, help="a mapper folder to judge with the gate as well")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--gpu-script", action="store_true", help="print the prepared one-GPU script and exit")
    args = parser.parse_args()
    if args.gpu_script:
        print((Path(__file__).parent / "handoff_gpu.py").read_text())
        return
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    from agentkv.handoff.offline.calibrated import ensure_calibrated
    from agentkv.vllm_launch import ensure_models

    models = ensure_models()
    mapper = ensure_calibrated(models.fast, models.slow, models.root / "mappers")
    with connector_pair(models, mapper, window=max(lengths) + 1024) as pair:
        rows = [measure(pair, length, args.repeats) for length in lengths]
    quality = quality_rows(models, mapper, Path(args.mapper) if args.mapper else None)
    if args.json:
        print(json.dumps({"ttft": rows, "quality": quality}))
        return
    print_tables(rows, quality)


class Pair:
    """The two running servers, their log files and the handoff's identity."""

    def __init__(self, fast: Any, slow: Any, mapper: Path) -> None:
        from agentkv.vllm_plugin import mapper_digest

        self.fast, self.slow, self.mapper, self.mapper_id = fast, slow, mapper, mapper_digest(mapper)


def connector_pair(models: Any, mapper: Path, *, window: int) -> Any:
    """Fast and slow vLLM servers with the connector, sharing a fresh store (a context manager)."""
    import contextlib
    import tempfile

    from agentkv.vllm_plugin import connector_config, connector_pythonpath
    from agentkv.vllm_launch import VLLMServer, ensure_venv, start_all

    @contextlib.contextmanager
    def pair() -> Any:
        python, store = ensure_venv(), Path(tempfile.mkdtemp(prefix="agentkv-kv-"))
        env = {"PYTHONPATH": str(connector_pythonpath())}
        fast = VLLMServer(python, models.fast, window=window, served_name="fast", kv_cache_gib=2,
                          kv_transfer=connector_config(store), extra_env=env)
        slow = VLLMServer(python, models.slow, window=window, served_name="slow", kv_cache_gib=2,
                          kv_transfer=connector_config(store, mappers={"fast": mapper}), extra_env=env)
        try:
            start_all(fast, slow)
            yield Pair(fast, slow, mapper)
        finally:
            fast.stop()
            slow.stop()

    return pair()


def text_of(tokens: int, root: str | None = None) -> str:
    """Unique text of about ``tokens`` tokens of the tier's tokenizer (sized with the server's /tokenize if given)."""
    items = max(1, tokens // 12)
    for _ in range(3 if root else 0):
        counted = len(httpx.post(root + "/tokenize", json={"model": "fast", "prompt": _items(items)},
                                 timeout=60.0).json()["tokens"])
        items = max(1, round(items * tokens / max(1, counted)))
    return _items(items)


def _items(count: int) -> str:
    return f"{uuid.uuid4()} " + " ".join(f"item{i} costs {i * 7 % 13} units" for i in range(count))


def chat(root: str, model: str, messages: list[dict[str, Any]], salt: str, params: dict[str, Any] | None = None,
         max_tokens: int = 1) -> tuple[dict[str, Any], float]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                            "cache_salt": salt, "logprobs": True, "top_logprobs": 5}
    if params is not None:
        body["kv_transfer_params"] = params
    started = time.perf_counter()
    answer = httpx.post(root + "/v1/chat/completions", json=body, timeout=600.0)
    answer.raise_for_status()
    return answer.json(), (time.perf_counter() - started) * 1e3


def connector_times(log: Path, export_id: str) -> dict[str, float]:
    """read/map/total ms of one import, from the slow server's connector log line."""
    pattern = re.compile(rf"agentkv import {export_id[:12]}: .*read ([0-9.]+) ms, map ([0-9.]+) ms, total ([0-9.]+) ms")
    for line in reversed(log.read_text(errors="replace").splitlines()):
        found = pattern.search(line)
        if found:
            return {"read_ms": float(found[1]), "map_ms": float(found[2]), "load_ms": float(found[3])}
    return {}


def once(pair: Pair, length: int) -> dict[str, Any]:
    """One prefix of ``length`` tokens escalated cold, mapped and warm."""
    from agentkv.vllm_plugin import export_params, export_result, handoff_salt, import_params, import_result

    prefix = [{"role": "user", "content": text_of(length, pair.fast.root)}]
    escalated = prefix + [{"role": "assistant", "content": "noted"}, {"role": "user", "content": text_of(100)}]
    tenant = uuid.uuid4().hex
    chat(pair.fast.root, "fast", prefix, tenant)  # fast served the conversation so far
    cold, cold_ms = chat(pair.slow.root, "slow", escalated, uuid.uuid4().hex)
    exported, export_ms = chat(pair.fast.root, "fast", prefix, tenant, export_params())
    export_id, exported_tokens = export_result(exported.get("kv_transfer_params")) or ("", 0)
    mapped, mapped_ms = chat(pair.slow.root, "slow", escalated, handoff_salt(tenant, pair.mapper_id),
                             import_params(export_id, mapper="fast"))
    loaded = (import_result(mapped.get("kv_transfer_params")) or (0, ""))[0]
    chat(pair.slow.root, "slow", prefix, tenant)  # the warm
    _, warm_ms = chat(pair.slow.root, "slow", escalated, tenant)
    return {"tokens": cold["usage"]["prompt_tokens"], "exported": exported_tokens, "mapped_tokens": loaded,
            "cold_ms": cold_ms, "export_ms": export_ms, "mapped_ms": mapped_ms, "warm_ms": warm_ms,
            **connector_times(pair.slow.log_path, export_id), **first_token(cold, mapped)}


def first_token(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """First greedy token equal (1/0), and KL(reference || other) over the reference's top-5, renormalised."""
    import math

    ref, got = (a["choices"][0]["logprobs"]["content"][0] for a in (reference, other))
    p = {t["token"]: math.exp(t["logprob"]) for t in ref["top_logprobs"]}
    q = {t["token"]: math.exp(t["logprob"]) for t in got["top_logprobs"]}
    floor = min(q.values()) / 10 if q else 1e-9
    p_sum, q_sum = sum(p.values()), sum(q.get(t, floor) for t in p)
    kl = sum(v / p_sum * math.log((v / p_sum) / (q.get(t, floor) / q_sum)) for t, v in p.items())
    return {"agreement": float(ref["token"] == got["token"]), "kl_top5": kl}


def measure(pair: Pair, length: int, repeats: int) -> dict[str, Any]:
    """Medians over ``repeats`` runs at one length (a first untimed run warms the servers' code paths)."""
    once(pair, min(length, 1024))
    runs = [once(pair, length) for _ in range(repeats)]
    row: dict[str, Any] = {"length": length}
    for key in runs[0]:
        values = [run[key] for run in runs if key in run]
        row[key] = statistics.median(values) if values else None
    return row


def quality_rows(models: Any, mapper: Path, extra: Path | None) -> list[dict[str, Any]]:
    """Held-out figures for identity and the tier's mapper (plus ``extra``), with the gate's decision."""
    from agentkv.handoff import choose_handoff
    from agentkv.handoff.served import MapperSummary

    rows = [{"mapper": "identity (slow -> slow)", "attention_cosine": 1.0, "greedy_agreement": 1.0, "mean_kl": 0.0,
             "gate": "map" if not choose_handoff("identity").replay else "replay"}]
    for name, folder in (("tier ridge fast -> slow", mapper), ("--mapper", extra)):
        if folder is None:
            continue
        figures = json.loads((folder / "manifest.json").read_text()).get("evaluation", {})
        plan = choose_handoff(MapperSummary.read(folder))
        rows.append({"mapper": name, "attention_cosine": figures.get("attention_cosine"),
                     "greedy_agreement": figures.get("greedy_agreement"), "mean_kl": figures.get("mean_kl"),
                     "gate": "map" if not plan.replay else f"replay ({plan.reason})"})
    return rows


def print_tables(rows: list[dict[str, Any]], quality: list[dict[str, Any]]) -> None:
    print("escalation TTFT on slow, ms (one-token requests; median)")
    print(f"{'prefix':>7s} {'tokens':>7s} {'cold':>8s} {'mapped':>8s} {'warm':>8s} {'export':>8s} {'read':>7s} "
          f"{'map':>7s} {'load':>7s} {'mapped tok':>10s} {'mapped/cold':>11s} {'agree':>6s} {'KL5':>6s}")
    for r in rows:
        print(f"{r['length']:7d} {r['tokens']:7.0f} {r['cold_ms']:8.0f} {r['mapped_ms']:8.0f} {r['warm_ms']:8.0f} "
              f"{r['export_ms']:8.0f} {r.get('read_ms') or 0:7.1f} {r.get('map_ms') or 0:7.1f} "
              f"{r.get('load_ms') or 0:7.1f} {r['mapped_tokens']:10.0f} {r['mapped_ms'] / r['cold_ms']:11.3f} "
              f"{r['agreement']:6.2f} {r['kl_top5']:6.3f}")
    print("\nquality against slow's own prefill (held-out text), and the gate at its default floor")
    for q in quality:
        print(f"  {q['mapper']:26s} cos {q['attention_cosine']:.4f}  greedy {q['greedy_agreement']:.3f}  "
              f"KL {q['mean_kl']:.4f}  gate: {q['gate']}")


if __name__ == "__main__":
    main()
