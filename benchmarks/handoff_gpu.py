"""The vLLM handoff's delivery path at Qwen3-14B -> 32B shapes on one GPU: export, store, map, load vs re-prefill.

Prepared for a machine with one large GPU (an H200: about 92 GB of the 139 go to the random-weight 32B target,
its caches and the mapper); nothing in the test suite needs it. Random weights throughout: timing does not depend
on their values. Per prompt length it times, on the GPU and the local disk, what AgentKVConnector does:

- export: gather a 14B-shaped cache (40 layers, 8 KV heads of 128, bf16) out of a paged CUDA-layout cache
  ([num_blocks, 16, kv_heads, head_dim] keys and values per layer, what FlashAttention reads), to the host, into
  the layout-independent safetensors form, written to disk with its sha256 (the store's format);
- import: read and check the file, to the GPU, map with a 14B -> 32B ridge map (k = 8: 64 target layers, two
  [8192, 1024] matrices each, RoPE stripped and reapplied), and write the 64 layers into the target's paged cache
  (vLLM's ``reshape_and_cache_flash`` when vLLM is importable, else the same scatter in torch);
- re-prefill: the 32B target's own prefill of the same tokens (transformers, sdpa), keeping the last logits.

    python benchmarks/handoff_gpu.py [--lengths 4096,8192,16384,32768] [--repeats 2] [--device cuda]
    python benchmarks/handoff_gpu.py --tiny --device cpu      # a smoke run of the same code on tiny shapes

Prints one JSON line per length and a table; the whole run takes about 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

PAGE = 16  # vLLM's CUDA block size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run anywhere)")
    args = parser.parse_args()
    from agentkv.handoff.offline.bench import qwen3_config

    overrides = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "vocab_size": 512} if args.tiny else {}
    source = qwen3_config("14b", **({**overrides, "num_hidden_layers": 3} if args.tiny else {}))
    target = qwen3_config("32b", **({**overrides, "num_hidden_layers": 5} if args.tiny else {}))
    lengths = [int(x) for x in args.lengths.split(",")] if not args.tiny else [64, 256]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    rows = run(source, target, lengths, device=args.device, dtype=dtype, repeats=args.repeats)
    print(f"{'tokens':>7s} {'export':>8s} {'store MB':>9s} {'read':>7s} {'map':>7s} {'load':>7s} "
          f"{'delivered':>10s} {'prefill':>9s} {'prefill/delivered':>18s}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['export_ms']:8.1f} {r['store_mb']:9.1f} {r['read_ms']:7.1f} {r['map_ms']:7.1f} "
              f"{r['load_ms']:7.1f} {r['delivered_ms']:10.1f} {r['prefill_ms']:9.1f} "
              f"{r['prefill_ms'] / r['delivered_ms']:18.1f}x")


def run(source_config: Any, target_config: Any, lengths: list[int], *, device: str, dtype: torch.dtype,
        repeats: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from agentkv.handoff.offline.bench import _default_inv_freq, random_ridge_mapper, reprefill
    from agentkv.handoff.rope import RopeTable
    from agentkv.handoff.signature import ModelSignature, SignaturePair

    started = time.perf_counter()
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(target_config, dtype=dtype).eval()
    pair = SignaturePair(ModelSignature.from_config(source_config), ModelSignature.from_config(target_config))
    mapper = random_ridge_mapper(pair, RopeTable(_default_inv_freq(source_config)), RopeTable.from_model(target), 8,
                                 device=device, dtype=dtype)
    print(json.dumps({"setup_s": round(time.perf_counter() - started, 1), "writer": writer_name()}), flush=True)
    rows = []
    for n in lengths:
        row = one_length(pair, mapper, n, device, dtype, repeats)
        tokens = torch.randint(0, int(target_config.vocab_size), (1, n), device=device)
        row["prefill_ms"] = median_ms(lambda tokens=tokens: reprefill(target, tokens), device, repeats)
        row["delivered_ms"] = row["export_ms"] + row["read_ms"] + row["map_ms"] + row["load_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def one_length(pair: Any, mapper: Any, n: int, device: str, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """Export, read, map and load of one ``n``-token prefix (medians)."""
    src, tgt = pair.source, pair.target
    blocks = list(torch.randperm(2 * (-(-n // PAGE)))[: -(-n // PAGE)].tolist())  # scattered, as a server's are
    source_cache = paged_cache(src.num_layers, 2 * len(blocks), src.kv_heads, src.head_dim, device, dtype)
    target_cache = paged_cache(tgt.num_layers, 2 * len(blocks), tgt.kv_heads, tgt.head_dim, device, dtype)
    slots = slot_mapping(blocks, 0, n, device)
    for k_cache, v_cache in source_cache:
        write(k_cache, v_cache, torch.randn(n, src.kv_heads, src.head_dim, device=device, dtype=dtype),
              torch.randn(n, src.kv_heads, src.head_dim, device=device, dtype=dtype), slots)
    folder = Path(tempfile.mkdtemp(prefix="agentkv-gpu-"))
    path = folder / "export.safetensors"
    export_ms = median_ms(lambda: export(source_cache, blocks, n, path), device, repeats)
    keys, values = read(path, device)
    read_ms = median_ms(lambda: read(path, device), device, repeats)
    mapped: list[Any] = [None]  # only the last run's result is kept (a 32K map of 64 layers is ~8.6 GB)
    map_ms = median_ms(lambda: mapped.__setitem__(0, map_kv(mapper, pair, keys, values, n)), device, repeats)
    target_keys, target_values = mapped[0]
    load_ms = median_ms(lambda: load(target_cache, target_keys, target_values, slots), device, repeats)
    size = path.stat().st_size
    path.unlink()
    return {"tokens": n, "export_ms": export_ms, "store_mb": size / 2**20, "read_ms": read_ms, "map_ms": map_ms,
            "load_ms": load_ms}


def paged_cache(layers: int, blocks: int, heads: int, dim: int, device: str, dtype: torch.dtype) -> list[Any]:
    """Per layer (keys, values), each [num_blocks, PAGE, kv_heads, head_dim]: vLLM's CUDA (NHD) layout."""
    return [(torch.zeros(blocks, PAGE, heads, dim, device=device, dtype=dtype),
             torch.zeros(blocks, PAGE, heads, dim, device=device, dtype=dtype)) for _ in range(layers)]


def slot_mapping(blocks: list[int], start: int, end: int, device: str) -> torch.Tensor:
    positions = torch.arange(start, end)
    return (torch.tensor(blocks)[positions // PAGE] * PAGE + positions % PAGE).to(device)


def writer_name() -> str:
    return "vllm reshape_and_cache_flash" if _vllm_writer() is not None else "torch scatter (vLLM not importable)"


def _vllm_writer() -> Callable[..., None] | None:
    try:
        from vllm import _custom_ops as ops

        return ops.reshape_and_cache_flash  # type: ignore[no-any-return]
    except Exception:
        return None


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          slots: torch.Tensor) -> None:
    """keys/values [tokens, kv_heads, head_dim] into the paged caches at ``slots``."""
    fused = _vllm_writer() if k_cache.is_cuda else None
    if fused is not None:
        scale = torch.ones((), device=k_cache.device, dtype=torch.float32)
        fused(keys, values, k_cache, v_cache, slots, "auto", scale, scale)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, keys)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, values)


def export(cache: list[Any], blocks: list[int], n: int, path: Path) -> None:
    """Gather each layer's first ``n`` tokens, to the host, safetensors bytes with their sha256, to disk."""
    from safetensors.torch import save

    index = torch.tensor(blocks, device=cache[0][0].device)
    tensors = {}
    for layer, (k_cache, v_cache) in enumerate(cache):
        tensors[f"keys.{layer}"] = k_cache.index_select(0, index).flatten(0, 1)[:n].to("cpu", non_blocking=True)
        tensors[f"values.{layer}"] = v_cache.index_select(0, index).flatten(0, 1)[:n].to("cpu", non_blocking=True)
    synchronize(cache[0][0].device)
    data = save(tensors)
    hashlib.sha256(data).hexdigest()
    path.write_bytes(data)


def read(path: Path, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The file back, sha256 checked, per layer [tokens, kv_heads, head_dim] on the device."""
    from safetensors.torch import load

    data = path.read_bytes()
    hashlib.sha256(data).hexdigest()
    tensors = load(data)
    layers = sum(1 for name in tensors if name.startswith("keys."))
    return ([tensors[f"keys.{i}"].to(device, non_blocking=True) for i in range(layers)],
            [tensors[f"values.{i}"].to(device, non_blocking=True) for i in range(layers)])


def map_kv(mapper: Any, pair: Any, keys: list[torch.Tensor], values: list[torch.Tensor], n: int) -> Any:
    """Source [tokens, H, D] per layer -> target per layer, as the connector's worker does."""
    from agentkv.handoff.cache import KVCache

    positions = torch.arange(n, device=keys[0].device).unsqueeze(0)
    cache = KVCache.from_layers([k.permute(1, 0, 2).unsqueeze(0) for k in keys],
                                [v.permute(1, 0, 2).unsqueeze(0) for v in values], pair.source, positions)
    out = mapper.map(cache, target_positions=positions)
    return [k[0].permute(1, 0, 2) for k in out.keys], [v[0].permute(1, 0, 2) for v in out.values]


def load(cache: list[Any], keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor) -> None:
    for (k_cache, v_cache), k, v in zip(cache, keys, values):
        write(k_cache, v_cache, k.contiguous(), v.contiguous(), slots)


def synchronize(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
