"""Calibration data: both models' position-free keys and values on the same tokens, flattened per layer.

    store = collect_from_models(source, target, sequences, heldout_fraction=0.2)
    store.source_keys            # [source_layers, tokens, kv_heads * head_dim]
    for rows in store.chunks("train", 4096): ...

Rows ``[0, n_train)`` are the fit split and the rest are held out; the split falls on a sequence
boundary whenever there is more than one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.mapping import flatten_layers
from agentkv.handoff.rope import RopeTable, model_cos_sin, strip_rope

Progress = Callable[[Iterable[Any], str], Iterable[Any]]


def no_progress(items: Iterable[Any], label: str) -> Iterable[Any]:
    """The default progress reporter: none."""
    return items


@dataclass(frozen=True)
class ActivationStore:
    """Flattened calibration activations. Every tensor: [layers, tokens, kv_heads * head_dim].

    Keys are RoPE-stripped when ``strip_rope`` is True, else left post-RoPE.
    """

    source_keys: torch.Tensor
    source_values: torch.Tensor
    target_keys: torch.Tensor
    target_values: torch.Tensor
    n_train: int
    strip_rope: bool = True

    @property
    def n_rows(self) -> int:
        """Token observations per layer."""
        return int(self.source_keys.shape[1])

    def split(self, name: str) -> slice:
        """Rows of ``"train"`` or ``"heldout"``."""
        return slice(0, self.n_train) if name == "train" else slice(self.n_train, self.n_rows)

    def chunks(self, name: str, chunk_rows: int) -> Iterator[slice]:
        """Consecutive row slices of at most ``chunk_rows`` within a split."""
        part = self.split(name)
        for start in range(part.start, part.stop, chunk_rows):
            yield slice(start, min(start + chunk_rows, part.stop))

    def source(self, kind: str) -> torch.Tensor:
        """``source_keys`` or ``source_values`` by kind (``"keys"``/``"values"``)."""
        return self.source_keys if kind == "keys" else self.source_values

    def target(self, kind: str) -> torch.Tensor:
        """``target_keys`` or ``target_values`` by kind."""
        return self.target_keys if kind == "keys" else self.target_values


def position_free_keys(cache: KVCache, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """Every layer's keys with RoPE removed, in float32. cos_sin: two [batch, seq, head_dim]."""
    cos, sin = cos_sin
    return [strip_rope(k.float(), cos, sin) for k in cache.keys]


def flatten_cache(
    cache: KVCache, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (stripped when ``cos_sin`` is given) and values as rows, each [layers, batch*seq, heads*head_dim]."""
    keys = position_free_keys(cache, cos_sin) if cos_sin is not None else [k.float() for k in cache.keys]
    return flatten_layers(keys).to("cpu", dtype), flatten_layers(cache.values).to("cpu", dtype)


def store_from_flat(
    pairs: Sequence[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]],
    heldout_fraction: float,
    strip: bool,
) -> ActivationStore:
    """Concatenate per-sequence ``((src_k, src_v), (tgt_k, tgt_v))`` rows and choose the held-out split."""
    if not pairs:
        raise ValueError("calibration needs at least one sequence")
    rows = [int(src[0].shape[1]) for src, _ in pairs]
    n_heldout_seqs = heldout_count(len(pairs), heldout_fraction)
    # whole trailing sequences are held out, or with one sequence its token tail
    n_train = sum(rows[: len(pairs) - n_heldout_seqs]) if n_heldout_seqs else int(rows[0] * (1 - heldout_fraction))
    if not 0 < n_train < sum(rows):
        raise ValueError(f"heldout_fraction={heldout_fraction} leaves no train or no held-out rows")
    # side 0/1 = source/target, kind 0/1 = keys/values; rows concatenate along dim 1
    src_k, src_v, tgt_k, tgt_v = (
        torch.cat([p[side][kind] for p in pairs], dim=1) for side in (0, 1) for kind in (0, 1)
    )
    return ActivationStore(src_k, src_v, tgt_k, tgt_v, n_train, strip)


def heldout_count(n_sequences: int, heldout_fraction: float) -> int:
    """How many trailing sequences are held out (0 with a single sequence: its token tail is)."""
    return max(1, round(n_sequences * heldout_fraction)) if n_sequences > 1 else 0


def collect_from_caches(
    caches: Iterable[tuple[KVCache, KVCache]],
    source_rope: RopeTable,
    target_rope: RopeTable,
    *,
    heldout_fraction: float = 0.2,
    strip: bool = True,
    dtype: torch.dtype = torch.float32,
) -> ActivationStore:
    """A store from ready-made ``(source, target)`` cache pairs over the same tokens, stripped with rope tables."""
    pairs = []
    for source, target in caches:
        src_cs = source_rope.cos_sin(source.positions) if strip else None
        tgt_cs = target_rope.cos_sin(target.positions) if strip else None
        pairs.append((flatten_cache(source, src_cs, dtype), flatten_cache(target, tgt_cs, dtype)))
    return store_from_flat(pairs, heldout_fraction, strip)


@torch.no_grad()
def prefill_cache(model: Any, tokens: torch.Tensor) -> KVCache:
    """Run ``model`` over tokens [batch, seq] and wrap its cache (positions ``0..seq-1``)."""
    from agentkv.handoff.models import model_device, output_cache, signature_of

    out = model(tokens.to(model_device(model)), use_cache=True, logits_to_keep=1)  # skip the LM head
    return KVCache.from_dynamic_cache(output_cache(out), signature_of(model))


def collect_from_models(
    source: Any,
    target: Any,
    sequences: Sequence[torch.Tensor],
    *,
    heldout_fraction: float = 0.2,
    strip: bool = True,
    dtype: torch.dtype = torch.float32,
    progress: Progress = no_progress,
) -> ActivationStore:
    """Run both models on every token sequence ([seq] or [batch, seq]) and keep their flattened KV.

    Keys are stripped with cos/sin from each model's own rotary module.
    """
    pairs = []
    for tokens in progress(sequences, "collect"):
        tokens = tokens.reshape(-1, tokens.shape[-1])
        flat = []
        for model in (source, target):
            cache = prefill_cache(model, tokens)
            cos_sin = model_cos_sin(model, cache.positions) if strip else None
            flat.append(flatten_cache(cache, cos_sin, dtype))
        pairs.append((flat[0], flat[1]))
    return store_from_flat(pairs, heldout_fraction, strip)
