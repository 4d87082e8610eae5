"""Map time vs target re-prefill, side by side, at growing prompt lengths.

Timing does not depend on the weights' values, so by default the mapper has random weights with the
real shapes (k source layers per target layer); pass a calibrated one to time that instead.

    rows = bench_models(build_model("small"), build_model("large"), lengths=(512, 2048, 8192))
    rows = bench_shapes(qwen3_config("14b"), qwen3_config("32b"), lengths=(4096, 32768), device="cuda")
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.offline.collect import prefill_cache
from agentkv.handoff.mapping import KINDS, MapGeometry
from agentkv.handoff.models import model_device, signature_of
from agentkv.handoff.ridge import RidgeMapper
from agentkv.handoff.rope import RopeTable
from agentkv.handoff.signature import ModelSignature, SignaturePair

QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-14B and Qwen3-32B: same KV geometry (8 KV heads of 128), different depth and width.
    "14b": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40},
    "32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64},
}
_QWEN3_COMMON = {"vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                 "rope_theta": 1_000_000.0, "tie_word_embeddings": False}


@dataclass(frozen=True)
class BenchRow:
    """One prompt length: median milliseconds to map the source cache and to re-prefill the target."""

    tokens: int
    map_ms: float
    prefill_ms: float

    @property
    def ratio(self) -> float:
        """How many times faster mapping is than re-prefilling."""
        return self.prefill_ms / self.map_ms if self.map_ms > 0 else float("inf")


def qwen3_config(size: str, **overrides: Any) -> Any:
    """A ``Qwen3Config`` with the shapes of Qwen3-14B or -32B (no weights)."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{**_QWEN3_COMMON, **QWEN3_SHAPES[size], **overrides})
    config._attn_implementation = "sdpa"
    config._name_or_path = f"Qwen3-{size.upper()}-shapes"
    return config


def random_ridge_mapper(
    pair: SignaturePair, source_rope: RopeTable, target_rope: RopeTable, k: int = 8, *,
    device: Any = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
) -> RidgeMapper:
    """A ridge mapper with the real shapes and random weights (source layers ``t, t+1, ...`` mod depth)."""
    k = min(k, pair.source.num_layers)
    gen = torch.Generator(device=device).manual_seed(seed)
    width_in = k * pair.source.kv_heads * pair.source.head_dim
    width_out = pair.target.kv_heads * pair.target.head_dim
    selected = tuple(tuple((t + i) % pair.source.num_layers for i in range(k)) for t in range(pair.target.num_layers))
    params = {}
    for t in range(pair.target.num_layers):
        for kind in KINDS:
            weight = torch.randn(width_in, width_out, generator=gen, device=device, dtype=dtype) / width_in**0.5
            params[f"{kind}.{t}.weight"] = weight
            params[f"{kind}.{t}.bias"] = torch.zeros(width_out, device=device, dtype=dtype)
    geometry = MapGeometry(pair, selected, source_rope, target_rope)
    return RidgeMapper(geometry, params, {"k": k, "weights": "random (timing only)"})


def synchronize(device: Any) -> None:
    """Wait for queued kernels on a CUDA device (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: Any, repeats: int) -> float:
    """Median wall time of ``fn`` in milliseconds over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


@torch.no_grad()
def reprefill(model: Any, tokens: torch.Tensor) -> None:
    """The target's own prefill of tokens [1, n], keeping only the last logits (as a server would)."""
    model(tokens, use_cache=True, logits_to_keep=1)


def random_cache(signature: ModelSignature, n: int, device: Any, dtype: torch.dtype, seed: int = 0) -> KVCache:
    """A cache of the signature's shape filled with noise: per layer [1, kv_heads, n, head_dim]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (1, signature.kv_heads, n, signature.head_dim)
    keys = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(signature.num_layers)]
    values = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(signature.num_layers)]
    return KVCache.from_layers(keys, values, signature)


def bench_lengths(
    mapper: Any, target: Any, lengths: Iterable[int], make_cache: Callable[[int], KVCache],
    repeats: int = 3, vocab: int = 1000,
) -> list[BenchRow]:
    """For each length: median map time of ``make_cache(n)`` and median re-prefill of the target."""
    device = model_device(target)
    rows = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (1, n), device=device)
        rows.append(bench_one(mapper, target, make_cache(n), tokens, repeats))
    return rows


def bench_one(mapper: Any, target: Any, cache: KVCache, tokens: torch.Tensor, repeats: int) -> BenchRow:
    """Median map time of ``cache`` and median re-prefill of tokens [1, n] by the target."""
    device = model_device(target)
    mapper.map(cache.prefix(min(cache.seq_len, 16)))  # warm-up (weights cast and moved once)
    map_ms = median_ms(lambda: mapper.map(cache), device, repeats)
    prefill_ms = median_ms(lambda: reprefill(target, tokens), device, repeats)
    return BenchRow(cache.seq_len, map_ms, prefill_ms)


def bench_models(
    source: Any, target: Any, lengths: Sequence[int] = (512, 2048, 8192), *, mapper: Any = None,
    k: int = 8, repeats: int = 3,
) -> list[BenchRow]:
    """Two real models: the source's own prefill makes each cache; the target re-prefills the same tokens."""
    device = model_device(target)
    pair = SignaturePair(signature_of(source), signature_of(target))
    mapper = mapper or random_ridge_mapper(pair, RopeTable.from_model(source), RopeTable.from_model(target), k,
                                           device=device)
    vocab = int(target.config.vocab_size)

    def make_cache(n: int) -> KVCache:
        return prefill_cache(source, torch.randint(0, vocab, (1, n)))

    return bench_lengths(mapper, target, fitting_lengths(lengths, target, device), make_cache, repeats, vocab)


def bench_shapes(
    source_config: Any, target_config: Any, lengths: Sequence[int] = (4096, 8192, 16384, 32768), *,
    device: Any = "cuda", dtype: torch.dtype = torch.bfloat16, k: int = 8, repeats: int = 3,
) -> list[BenchRow]:
    """Shapes only (e.g. Qwen3-14B -> 32B): a random target model, random source caches, a random map."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        target = AutoModelForCausalLM.from_config(target_config, dtype=dtype).eval()
    pair = SignaturePair(ModelSignature.from_config(source_config), ModelSignature.from_config(target_config))
    source_rope = RopeTable(_default_inv_freq(source_config))
    mapper = random_ridge_mapper(pair, source_rope, RopeTable.from_model(target), k, device=device, dtype=dtype)
    return bench_lengths(mapper, target, fitting_lengths(lengths, target, device),
                         lambda n: random_cache(pair.source, n, device, dtype), repeats,
                         int(target_config.vocab_size))


def _default_inv_freq(config: Any) -> torch.Tensor:
    sig = ModelSignature.from_config(config)
    return 1.0 / (sig.rope_theta ** (torch.arange(0, sig.head_dim, 2, dtype=torch.float) / sig.head_dim))


def fitting_lengths(lengths: Iterable[int], target: Any, device: Any) -> list[int]:
    """The lengths whose caches and activations should fit in free memory (rough, 1.5x headroom) and window."""
    free = free_bytes(device)
    config = target.config
    limit = int(getattr(config, "max_position_embeddings", 1 << 30))
    per_token = per_token_bytes(config, next(target.parameters()).element_size())
    return [n for n in lengths if n <= limit and 1.5 * n * per_token < free]


def per_token_bytes(config: Any, element: int) -> int:
    """Rough bytes per prompt token: target KV, a source-sized KV, mapper features, and one layer's activations."""
    sig = ModelSignature.from_config(config)
    kv = 2 * sig.num_layers * sig.kv_heads * sig.head_dim * element
    activations = (4 * config.hidden_size + 2 * config.intermediate_size) * element
    return 3 * kv + 8 * sig.kv_heads * sig.head_dim * element + activations


def free_bytes(device: Any) -> int:
    """Free memory on the device (CUDA: ``mem_get_info``; CPU: available physical pages)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def format_rows(rows: Sequence[BenchRow]) -> list[tuple[str, str, str, str]]:
    """Table cells: tokens, map ms, re-prefill ms, ratio."""
    return [(f"{r.tokens:,}", f"{r.map_ms:,.1f}", f"{r.prefill_ms:,.1f}", f"{r.ratio:,.1f}x") for r in rows]
