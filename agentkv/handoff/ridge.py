"""``ridge``: the closed-form linear KV map (Cross-Model KV Cache Transfer in LLM Families, 2026).

Per target layer and per kind (keys, values): ``y = x @ W + b`` with ``x`` the concatenated heads of
the k best source layers (position-free keys) and ``W = (XcᵀXc + λI)⁻¹ XcᵀYc`` solved in float64
from streamed statistics. Every target head has its own output columns.

    mapper = RidgeMapper.fit(store, geometry, CalibrationConfig(lam=0.01))
    target_cache = mapper.map(source_cache)
    mapper.save("mappers/14b-to-32b"); RidgeMapper.load("mappers/14b-to-32b")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentkv.handoff.learned import LearnedMapper, Params, each_map
from agentkv.handoff.manifest import Header, Selected, Shape
from agentkv.handoff.mapping import MapGeometry
from agentkv.handoff.signature import SignaturePair

if TYPE_CHECKING:
    from agentkv.handoff.offline.collect import ActivationStore, Progress
    from agentkv.handoff.offline.config import CalibrationConfig


class RidgeMapper(LearnedMapper):
    """Per target layer ``t`` and kind: ``{kind}.{t}.weight`` [k*H*D, H*D] and ``{kind}.{t}.bias`` [H*D]."""

    name = "ridge"

    @staticmethod
    def transform(params: Params, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        """One matmul: (N, k*H*D) @ (k*H*D, H*D) + (H*D) -> (N, H*D)."""
        return torch.addmm(params[f"{kind}.{layer}.bias"], x, params[f"{kind}.{layer}.weight"])

    @staticmethod
    def param_shapes(pair: SignaturePair, selected: Selected, header: Header) -> dict[str, Shape]:
        """weight [k*Hs*Ds, Ht*Dt] and bias [Ht*Dt] per target layer and kind."""
        width_in, width_out = pair.source.kv_heads * pair.source.head_dim, pair.target.kv_heads * pair.target.head_dim
        shapes: dict[str, Shape] = {}
        for layer, chosen, kind in each_map(selected):
            shapes[f"{kind}.{layer}.weight"] = (len(chosen) * width_in, width_out)
            shapes[f"{kind}.{layer}.bias"] = (width_out,)
        return shapes

    @classmethod
    def fit(cls, store: ActivationStore, geometry: MapGeometry, config: CalibrationConfig | None = None,
            progress: Progress | None = None) -> RidgeMapper:
        """Solve every target layer's key and value map on the store's train split (offline:
        :func:`agentkv.handoff.offline.fit.fit_ridge`; a process that only maps never imports it)."""
        from agentkv.handoff.offline.fit import fit_ridge

        return fit_ridge(cls, store, geometry, config, progress)
