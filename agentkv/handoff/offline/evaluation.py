"""How good a mapped cache is, measured where it matters: the target's own attention and next tokens.

For each token sequence (all but its last token are cached):

- per target layer R² of mapped vs true keys (post-RoPE) and values;
- attention-output cosine: the target's own post-RoPE queries (captured by forward hooks) attend
  causally over the true and over the mapped KV (GQA: query head ``h`` reads kv head ``h // groups``);
  cosine of the two outputs, averaged over tokens and heads, per layer and overall;
- decoding: from each cache the target decodes ``decode_tokens`` steps fed the same tokens (its own
  greedy continuation from the true cache) -> greedy next-token agreement and mean KL(true || mapped).

    figures = evaluate(mapper, source, target, held_out_sequences)
    figures.attention_cosine, figures.greedy_agreement, figures.to_dict()
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch.nn import functional as F

from agentkv.handoff.cache import KVCache
from agentkv.handoff.mapping import flatten_layers
from agentkv.handoff.offline.collect import Progress, no_progress, prefill_cache
from agentkv.handoff.offline.linalg import R2Accumulator
from agentkv.handoff.models import attention_modules, forward_with_cache, model_device, signature_of
from agentkv.handoff.protocol import KVMapper
from agentkv.handoff.rope import apply_rope, model_cos_sin


@dataclass(frozen=True)
class Evaluation:
    """Figures for one mapper on some token sequences (per-layer tuples index target layers)."""

    key_r2: tuple[float, ...]
    value_r2: tuple[float, ...]
    attention_cosine_per_layer: tuple[float, ...]
    attention_cosine: float
    greedy_agreement: float
    mean_kl: float
    tokens: int
    decode_tokens: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (what a manifest's ``evaluation`` holds)."""
        return asdict(self)


@dataclass
class _Totals:
    layers: int
    r2: dict[str, list[R2Accumulator]] = field(init=False)
    cos_sum: torch.Tensor = field(init=False)
    cos_count: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    steps: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        self.r2 = {kind: [R2Accumulator() for _ in range(self.layers)] for kind in ("keys", "values")}
        self.cos_sum = torch.zeros(self.layers, dtype=torch.float64)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention with grouped KV heads, in float32.

    q: [batch, q_heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim] -> [batch, q_heads, seq, head_dim]
    """
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)  # (B, Hkv, T, D) -> (B, Hq, T, D)
    v = v.float().repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q.float(), k, v, is_causal=True, scale=scale)


@contextlib.contextmanager
def captured_queries(model: Any) -> Iterator[list[torch.Tensor]]:
    """Forward hooks that keep every layer's pre-RoPE queries as [batch, seq, q_heads, head_dim].

    Hooks ``q_norm`` when the attention has one (Qwen3), else ``q_proj`` (Llama).
    """
    store: list[torch.Tensor] = []
    handles = []
    for attn in attention_modules(model):
        source = getattr(attn, "q_norm", None) or attn.q_proj
        dim = attn.head_dim

        def hook(module: Any, args: Any, out: torch.Tensor, dim: int = dim) -> None:
            store.append(out.detach().reshape(out.shape[0], out.shape[1], -1, dim))  # (B, T, Hq*D) -> (B, T, Hq, D)

        handles.append(source.register_forward_hook(hook))
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def prefill_with_queries(model: Any, tokens: torch.Tensor) -> tuple[KVCache, list[torch.Tensor]]:
    """The model's cache over tokens [batch, seq] and its post-RoPE queries.

    -> (cache, queries) with queries[i]: [batch, q_heads, seq, head_dim] for layer ``i``.
    """
    with captured_queries(model) as raw:
        cache = prefill_cache(model, tokens)
    cos, sin = model_cos_sin(model, cache.positions)
    return cache, [apply_rope(q.transpose(1, 2).float(), cos, sin) for q in raw]  # (B, T, Hq, D) -> (B, Hq, T, D)


def attention_scales(model: Any) -> list[float]:
    """Each layer's softmax scale (``attn.scaling``, else ``head_dim ** -0.5``)."""
    return [float(getattr(a, "scaling", a.head_dim**-0.5)) for a in attention_modules(model)]


def add_kv_figures(totals: _Totals, true: KVCache, mapped: KVCache) -> None:
    """Per-layer R² of keys and values, rows = tokens, columns = (head, dim)."""
    for kind in ("keys", "values"):
        true_rows, mapped_rows = flatten_layers(getattr(true, kind)), flatten_layers(getattr(mapped, kind))
        for layer in range(totals.layers):
            totals.r2[kind][layer].update(true_rows[layer], mapped_rows[layer])


def add_attention_figures(
    totals: _Totals, queries: list[torch.Tensor], scales: list[float], true: KVCache, mapped: KVCache
) -> None:
    """Sum of per-(batch, head, token) cosines between attention over true and over mapped KV."""
    for layer, (q, scale) in enumerate(zip(queries, scales, strict=True)):
        out_true = causal_attention(q, true.keys[layer], true.values[layer], scale)
        out_mapped = causal_attention(q, mapped.keys[layer].to(q.device), mapped.values[layer].to(q.device), scale)
        cos = F.cosine_similarity(out_true, out_mapped, dim=-1)  # (B, Hq, T)
        totals.cos_sum[layer] += cos.double().sum().cpu()
    totals.cos_count += int(cos.numel())


@torch.no_grad()
def add_decode_figures(
    totals: _Totals, model: Any, true: KVCache, mapped: KVCache, last: torch.Tensor, steps: int
) -> None:
    """Teacher-forced greedy decode from both caches: argmax agreement and KL(true || mapped) per step."""
    caches = (true.to_dynamic_cache(), mapped.to(dtype=true.keys[0].dtype).to_dynamic_cache())
    token = last
    for _ in range(steps):
        logits = [forward_with_cache(model, token, cache).logits[:, -1].float() for cache in caches]
        logp_true, logp_mapped = (F.log_softmax(x, dim=-1) for x in logits)
        totals.agree += int((logp_true.argmax(-1) == logp_mapped.argmax(-1)).sum())
        totals.kl_sum += float((logp_true.exp() * (logp_true - logp_mapped)).sum())
        totals.steps += int(token.shape[0])
        token = logp_true.argmax(-1, keepdim=True)


def evaluate(
    mapper: KVMapper,
    source_model: Any,
    target_model: Any,
    tokens: Sequence[torch.Tensor] | torch.Tensor,
    *,
    decode_tokens: int = 8,
    progress: Progress = no_progress,
) -> Evaluation:
    """Map each sequence's source cache and compare it with the target's own.

    tokens: sequences of [seq] or [batch, seq] (or one [batch, seq] tensor); the last token of each is
    not cached but fed to the decode.
    """
    sequences = [tokens] if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else list(tokens)
    totals = _Totals(signature_of(target_model).num_layers)
    scales = attention_scales(target_model)
    device = model_device(target_model)
    for seq in progress(sequences, "evaluate"):
        seq = seq.reshape(-1, seq.shape[-1]).to(device)
        true, queries = prefill_with_queries(target_model, seq[:, :-1])
        source = prefill_cache(source_model, seq[:, :-1])
        mapped = mapper.map(source).to(device=device)
        add_kv_figures(totals, true, mapped)
        add_attention_figures(totals, queries, scales, true, mapped)
        add_decode_figures(totals, target_model, true, mapped, seq[:, -1:], decode_tokens)
        totals.tokens += int(seq[:, :-1].numel())
    return summarise(totals, decode_tokens)


def summarise(totals: _Totals, decode_tokens: int) -> Evaluation:
    """Averages of the accumulated figures."""
    per_layer = totals.cos_sum / max(totals.cos_count, 1)
    steps = max(totals.steps, 1)
    return Evaluation(
        key_r2=tuple(float(a.scores()[0]) for a in totals.r2["keys"]),
        value_r2=tuple(float(a.scores()[0]) for a in totals.r2["values"]),
        attention_cosine_per_layer=tuple(float(c) for c in per_layer),
        attention_cosine=float(per_layer.mean()),
        greedy_agreement=totals.agree / steps,
        mean_kl=max(0.0, totals.kl_sum / steps),  # KL >= 0; float noise can dip below
        tokens=totals.tokens,
        decode_tokens=decode_tokens,
    )
