"""``mlp``: a small nonlinear KV map for pairs where the linear map fails.

Same features, RoPE handling, selection and file format as ``ridge``; per target layer and kind the
transform is ``linear -> GELU -> linear``, trained with Adam on mini-batches (fixed seed) with early
stopping on the held-out split. Inputs and outputs are standardised while training and the scaling is
folded into the saved weights, so mapping is exactly two matmuls.

    mapper = MLPMapper.fit(store, geometry, CalibrationConfig(mlp=MLPConfig(hidden=256)))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from agentkv.handoff.learned import LearnedMapper, Params, each_map
from agentkv.handoff.manifest import Header, Selected, Shape
from agentkv.handoff.mapping import MapGeometry
from agentkv.handoff.signature import SignaturePair

if TYPE_CHECKING:
    from agentkv.handoff.offline.collect import ActivationStore, Progress
    from agentkv.handoff.offline.config import CalibrationConfig


class MLPMapper(LearnedMapper):
    """Per target layer ``t`` and kind: ``w1`` [hidden, k*H*D], ``b1`` [hidden], ``w2`` [H*D, hidden], ``b2`` [H*D]."""

    name = "mlp"

    @staticmethod
    def transform(params: Params, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        """linear -> GELU -> linear: (N, k*H*D) -> (N, hidden) -> (N, H*D)."""
        p = {n: params[f"{kind}.{layer}.{n}"] for n in ("w1", "b1", "w2", "b2")}
        hidden = nn.functional.gelu(torch.addmm(p["b1"], x, p["w1"].T))
        return torch.addmm(p["b2"], hidden, p["w2"].T)

    @staticmethod
    def param_shapes(pair: SignaturePair, selected: Selected, header: Header) -> dict[str, Shape]:
        """w1 [h, k*Hs*Ds], b1 [h], w2 [Ht*Dt, h], b2 [Ht*Dt] per target layer and kind; h is read from w1."""
        width_in, width_out = pair.source.kv_heads * pair.source.head_dim, pair.target.kv_heads * pair.target.head_dim
        shapes: dict[str, Shape] = {}
        for layer, chosen, kind in each_map(selected):
            prefix = f"{kind}.{layer}"
            w1 = header.get(f"{prefix}.w1", ((), ""))[0]
            hidden = w1[0] if len(w1) == 2 and w1[0] > 0 else 1  # a bad w1 is reported against h = 1
            shapes.update({f"{prefix}.w1": (hidden, len(chosen) * width_in), f"{prefix}.b1": (hidden,),
                           f"{prefix}.w2": (width_out, hidden), f"{prefix}.b2": (width_out,)})
        return shapes

    @classmethod
    def fit(cls, store: ActivationStore, geometry: MapGeometry, config: CalibrationConfig | None = None,
            progress: Progress | None = None) -> MLPMapper:
        """Train every target layer's key and value MLP on the train split, stopping on held-out loss (offline:
        :func:`agentkv.handoff.offline.fit.fit_mlp`; a process that only maps never imports it)."""
        from agentkv.handoff.offline.fit import fit_mlp

        return fit_mlp(cls, store, geometry, config, progress)
