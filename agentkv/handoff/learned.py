"""``LearnedMapper``: the plumbing ``ridge`` and ``mlp`` share (signatures, device casting, save/load).

A subclass sets ``name`` and implements ``transform(params, layer, kind, x)`` and ``fit``; the map
pipeline, the gate figure and the file format come from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.mapping import (
    KINDS, MapGeometry, held_out_cosine, load_files, map_cache, save_files, with_evaluation,
)
from agentkv.handoff.manifest import Header, Selected, Shape
from agentkv.handoff.signature import SignaturePair

Params = dict[str, torch.Tensor]


def each_map(selected: Selected,
             progress: Callable[[Iterable[Any], str], Iterable[Any]] | None = None) -> Iterator[tuple[int, tuple[int, ...], str]]:
    """Every map a learned mapper holds, in order: ``(target layer, the source layers it reads, kind)``, a target
    layer's key map then its value map; ``progress`` (a calibration's reporter) sees the layers go by."""
    layers: Iterable[Any] = range(len(selected))
    for layer in progress(layers, "fit") if progress is not None else layers:
        for kind in KINDS:
            yield layer, tuple(selected[layer]), kind
Self = TypeVar("Self", bound="LearnedMapper")

_GEOMETRY_FIELDS = frozenset(
    {"backend", "format_version", "signatures", "selected_layers", "strip_rope", "attention_scaling"}
)


class LearnedMapper:
    """A fitted map: a :class:`MapGeometry`, named float32 ``params`` and an ``info`` dict for the manifest."""

    name = "learned"

    def __init__(self, geometry: MapGeometry, params: Params, info: dict[str, Any] | None = None) -> None:
        self.geometry = geometry
        self.params = params
        self.info = dict(info or {})
        self._cast: dict[tuple[Any, Any], Params] = {}

    @property
    def signature_pair(self) -> SignaturePair:
        return self.geometry.pair

    @property
    def moves_kv(self) -> bool:
        return True

    @property
    def attention_cosine(self) -> float | None:
        return held_out_cosine(self.info)

    def with_evaluation(self: Self, figures: dict[str, Any]) -> Self:
        """The same map with evaluation figures recorded in its info (what the gate reads)."""
        return type(self)(self.geometry, self.params, with_evaluation(self.info, figures))

    @staticmethod
    def transform(params: Params, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, k*kv_heads*head_dim] -> [rows, kv_heads*head_dim] for target ``layer`` and ``kind``."""
        raise NotImplementedError

    def map(self, cache: KVCache, target_positions: torch.Tensor | None = None) -> KVCache:
        """Source cache (keys/values [batch, kv_heads, seq, head_dim]) -> target cache, same device and dtype."""
        params = self._params_on(cache.keys[0].device, cache.keys[0].dtype)
        return map_cache(
            cache, self.geometry, lambda layer, kind, x: self.transform(params, layer, kind, x), target_positions
        )

    def _params_on(self, device: Any, dtype: Any) -> Params:
        key = (device, dtype)
        if key not in self._cast:
            self._cast[key] = {name: p.to(device=device, dtype=dtype) for name, p in self.params.items()}
        return self._cast[key]

    def save(self, path: str | Path) -> None:
        manifest = {"backend": self.name, **self.geometry.to_manifest(), **self.info}
        save_files(path, manifest, {**self.params, **self.geometry.rope_tensors()})

    @staticmethod
    def param_shapes(pair: SignaturePair, selected: Selected, header: Header) -> dict[str, Shape]:
        """The parameter tensors a file must hold and their shapes; this default accepts the file's own."""
        return {name: shape for name, (shape, _) in header.items() if not name.startswith("rope.")}

    @classmethod
    def load(cls: type[Self], path: str | Path) -> Self:
        """Read a directory written by :meth:`save`, every field and tensor checked (:class:`MapperFileError`)."""
        manifest, geometry, params = load_files(path, cls.name, cls.param_shapes)
        info = {k: v for k, v in manifest.items() if k not in _GEOMETRY_FIELDS}
        return cls(geometry, params, info)
