"""What every learned mapper shares: layer selection, RoPE handling, the map pipeline and the file format.

A learned mapper is a :class:`MapGeometry` plus a per-target-layer transform ``(layer, kind, x) -> y``
with ``x: [rows, k * kv_heads * head_dim]`` (the k selected source layers, all heads concatenated)
and ``y: [rows, kv_heads * head_dim]``. :func:`map_cache` does the rest.

Files: ``manifest.json`` (backend, signatures, selection, hyper-parameters, evaluation figures) and
``weights.safetensors`` (transform weights and both rope tables). Nothing is ever unpickled.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.errors import MapperFileError
from agentkv.handoff.manifest import (
    Header, Selected, Shape, check_backend, check_tensors, geometry_fields, rope_shapes,
)
from agentkv.handoff.protocol import check_source
from agentkv.handoff.registry import MANIFEST, read_manifest
from agentkv.handoff.rope import RopeTable, apply_rope, inverse_cos_sin
from agentkv.handoff.signature import SignaturePair

WEIGHTS = "weights.safetensors"
FORMAT_VERSION = 1
KINDS = ("keys", "values")

Transform = Callable[[int, str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MapGeometry:
    """Which source layers feed each target layer, and how positions are handled.

    selected[t]: the source layer indices (best first) whose KV predicts target layer ``t``.
    strip_rope: fit and map in position-free space (re-applying the target's RoPE), else post-RoPE.
    """

    pair: SignaturePair
    selected: tuple[tuple[int, ...], ...]
    source_rope: RopeTable
    target_rope: RopeTable
    strip_rope: bool = True

    def to_manifest(self) -> dict[str, Any]:
        """JSON-ready fields (rope tables go to the weights file)."""
        return {
            "signatures": self.pair.to_dict(),
            "selected_layers": [list(s) for s in self.selected],
            "strip_rope": self.strip_rope,
            "attention_scaling": {"source": self.source_rope.attention_scaling,
                                  "target": self.target_rope.attention_scaling},
        }

    def rope_tensors(self) -> dict[str, torch.Tensor]:
        """The rope tables as named tensors."""
        return {"rope.source.inv_freq": self.source_rope.inv_freq, "rope.target.inv_freq": self.target_rope.inv_freq}


def token_major(layers: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-layer tensors as token rows.

    layers[i]: [batch, heads, seq, head_dim] -> [batch*seq, layers, heads*head_dim]
    """
    stacked = torch.stack(tuple(layers))  # (L, B, H, T, D)
    n_layers, batch, heads, seq, dim = stacked.shape
    return stacked.permute(1, 3, 0, 2, 4).reshape(batch * seq, n_layers, heads * dim).to(dtype)  # -> (B*T, L, H*D)


def source_rows(cache: KVCache, geometry: MapGeometry) -> dict[str, torch.Tensor]:
    """All source layers as token rows (keys stripped if the geometry says so).

    -> kind -> [batch*seq, layers, heads*head_dim]
    """
    dtype = cache.keys[0].dtype
    keys: Sequence[torch.Tensor] = cache.keys
    if geometry.strip_rope:
        cos, sin = inverse_cos_sin(*geometry.source_rope.cos_sin(cache.positions))  # computed once
        keys = [apply_rope(k.float(), cos, sin) for k in keys]
    return {"keys": token_major(keys, dtype), "values": token_major(cache.values, dtype)}


def select_features(rows: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The selected layers' heads side by side per token. rows: [n, layers, width] -> [n, k * width]."""
    picked = rows.index_select(1, torch.tensor(layers, device=rows.device))  # (N, L, W) -> (N, k, W)
    return picked.reshape(picked.shape[0], -1)  # (N, k, W) -> (N, k*W), a view


def gather_features(rows: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """Same features from layer-major calibration rows. rows: [layers, n, width] -> [n, k * width]."""
    picked = rows.index_select(0, torch.tensor(layers, device=rows.device))  # (L, N, W) -> (k, N, W)
    return picked.permute(1, 0, 2).reshape(picked.shape[1], -1)  # (k, N, W) -> (N, k*W)


@torch.no_grad()
def map_cache(
    cache: KVCache, geometry: MapGeometry, transform: Transform, target_positions: torch.Tensor | None = None
) -> KVCache:
    """Source cache -> target cache on the cache's device and dtype.

    For every target layer: gather the selected (stripped) source layers, one transform for keys and
    one for values, then the target's RoPE at ``target_positions`` ([batch, seq]; default the source's).
    """
    check_source(geometry.pair, cache)
    positions = cache.positions if target_positions is None else target_positions.to(cache.positions.device)
    batch, heads = cache.batch, geometry.pair.target.kv_heads
    rows = source_rows(cache, geometry)
    out: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
    for layer, chosen in enumerate(geometry.selected):
        for kind in KINDS:
            y = transform(layer, kind, select_features(rows[kind], chosen))  # (B*T, H*D)
            out[kind].append(unflatten_rows(y, batch, heads))  # -> (B, H, T, D)
    if geometry.strip_rope:
        cos, sin = geometry.target_rope.cos_sin(positions)
        out["keys"] = [apply_rope(k.float(), cos, sin).to(k.dtype) for k in out["keys"]]
    return KVCache(tuple(out["keys"]), tuple(out["values"]), positions, geometry.pair.target)


def save_files(path: str | Path, manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``manifest.json`` and ``weights.safetensors`` into directory ``path``."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    plain = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}  # no shared storage
    save_file(plain, str(folder / WEIGHTS), metadata={"format_version": str(FORMAT_VERSION)})
    body = {"format_version": FORMAT_VERSION, **manifest}
    (folder / MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


ParamShapes = Callable[[SignaturePair, Selected, Header], dict[str, Shape]]
"""A backend's parameter tensors and their shapes, given the geometry (and the header, for sizes it chose)."""


def load_files(
    path: str | Path, backend: str, param_shapes: ParamShapes
) -> tuple[dict[str, Any], MapGeometry, dict[str, torch.Tensor]]:
    """Read a mapper directory written by ``backend``: ``(manifest, geometry, parameter tensors)``.

    Every manifest field is type-checked and every tensor's name, shape and dtype checked against the
    signatures and ``param_shapes`` before any tensor is read; anything amiss is a :class:`MapperFileError`.
    """
    where = str(path)
    manifest = read_manifest(path)
    check_backend(manifest, backend, FORMAT_VERSION, where)
    pair, selected, strip, (source_scale, target_scale) = geometry_fields(manifest, where)
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise MapperFileError(f"{path} has no {WEIGHTS}")
    with _opened(weights) as file:
        header = {name: _described(file.get_slice(name)) for name in file.keys()}
        check_tensors(header, {**rope_shapes(pair), **param_shapes(pair, selected, header)}, where)
        tensors = {name: file.get_tensor(name) for name in header}
    geometry = MapGeometry(pair, selected, RopeTable(tensors.pop("rope.source.inv_freq"), source_scale),
                           RopeTable(tensors.pop("rope.target.inv_freq"), target_scale), strip)
    return manifest, geometry, tensors


def _described(tensor: Any) -> tuple[Shape, str]:
    """A safetensors slice's header entry: (shape, dtype string), no data read."""
    return tuple(tensor.get_shape()), tensor.get_dtype()


@contextmanager
def _opened(weights: Path) -> Iterator[Any]:
    """safetensors' reader (which never unpickles), its own errors raised as :class:`MapperFileError`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as file:
            yield file
    except (SafetensorError, OSError, RuntimeError) as error:
        raise MapperFileError(f"{weights} is not a readable safetensors file: {type(error).__name__}: "
                              f"{str(error)[:200]}") from error


def with_evaluation(info: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """A copy of a mapper's info with evaluation figures merged in."""
    return {**info, "evaluation": {**info.get("evaluation", {}), **figures}}


def held_out_cosine(info: dict[str, Any]) -> float | None:
    """The gate figure from a mapper's info, if measured."""
    value = info.get("evaluation", {}).get("attention_cosine")
    return None if value is None else float(value)


def flatten_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack per-layer tensors into rows.

    layers[i]: [batch, heads, seq, head_dim] -> [layers, batch*seq, heads*head_dim]
    """
    stacked = torch.stack(tuple(layers))  # (L, B, H, T, D)
    n_layers, batch, heads, seq, dim = stacked.shape
    return stacked.permute(0, 1, 3, 2, 4).reshape(n_layers, batch * seq, heads * dim)  # -> (L, B*T, H*D)


def unflatten_rows(rows: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Inverse of one layer of :func:`flatten_layers`.

    rows: [batch*seq, heads*head_dim] -> [batch, heads, seq, head_dim]
    """
    total, width = rows.shape
    split = rows.reshape(batch, total // batch, heads, width // heads)  # (B*T, H*D) -> (B, T, H, D)
    return split.permute(0, 2, 1, 3)  # (B, T, H, D) -> (B, H, T, D)
