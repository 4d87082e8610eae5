"""Calibration settings as small frozen value objects (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MLPConfig:
    """The ``mlp`` backend's training settings: linear -> GELU -> linear per target layer and kind.

        MLPConfig(hidden=512, lr=1e-3, max_epochs=200, batch_size=256, patience=10, seed=0)

    ``hidden`` None means ``kv_heads * head_dim`` of the target.
    """

    hidden: int | None = None
    lr: float = 3e-3
    max_epochs: int = 200
    batch_size: int = 256
    patience: int = 10
    weight_decay: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class CalibrationConfig:
    """How a mapper is fitted.

        CalibrationConfig(k=8, lam=0.01, heldout_fraction=0.2)

    - ``k``: source layers per target layer (capped at the source's layer count).
    - ``lam``: ridge penalty on the mean-centred normal equations.
    - ``heldout_fraction``: share of sequences (or tokens, with one sequence) held out for layer
      ranking, early stopping and the quality figures.
    - ``strip_rope``: fit in position-free space (keep True; False exists to show why).
    - ``chunk_rows``: token rows per streamed float64 update.
    - ``eval_decode_tokens``: greedy tokens decoded when evaluating after calibration.
    - ``store_dtype``: dtype the collected activations are kept in (``"bfloat16"`` halves memory at
      paper scale; the statistics are accumulated in float64 either way).
    """

    k: int = 8
    lam: float = 0.01
    heldout_fraction: float = 0.2
    strip_rope: bool = True
    chunk_rows: int = 4096
    eval_decode_tokens: int = 8
    store_dtype: str = "float32"
    mlp: MLPConfig = field(default_factory=MLPConfig)
