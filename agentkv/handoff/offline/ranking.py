"""Layer selection: for each target layer, rank every source layer by single-layer ridge R² on held-out rows.

    scores = single_layer_r2(store, lam=0.01)     # [target_layers, source_layers]
    selected = select_layers(scores, k=8)         # per target layer, best source layers first
"""

from __future__ import annotations

import torch

from agentkv.handoff.offline.collect import ActivationStore, Progress, no_progress
from agentkv.handoff.offline.linalg import R2Accumulator, RidgeAccumulator
from agentkv.handoff.mapping import KINDS


def single_layer_r2(
    store: ActivationStore, lam: float = 0.01, chunk_rows: int = 4096, progress: Progress = no_progress
) -> torch.Tensor:
    """Held-out R² of predicting each target layer from each single source layer, keys and values averaged.

    -> [target_layers, source_layers] float64.
    """
    n_source, n_target = store.source_keys.shape[0], store.target_keys.shape[0]
    scores = torch.zeros(n_target, n_source, dtype=torch.float64)
    for s in progress(range(n_source), "rank"):
        for kind in KINDS:
            scores[:, s] += source_layer_scores(store, s, kind, lam, chunk_rows) / len(KINDS)
    return scores


def source_layer_scores(store: ActivationStore, s: int, kind: str, lam: float, chunk_rows: int) -> torch.Tensor:
    """One source layer against all target layers at once: fit on train, R² per target layer on held-out."""
    source, target = store.source(kind), store.target(kind)
    n_target, _, width = target.shape
    acc = RidgeAccumulator(source.shape[2], n_target * width)
    for rows in store.chunks("train", chunk_rows):
        acc.update(source[s, rows], all_layers(target, rows))
    weight, bias = acc.solve(lam)
    r2 = R2Accumulator(groups=n_target)
    for rows in store.chunks("heldout", chunk_rows):
        r2.update(all_layers(target, rows), torch.addmm(bias, source[s, rows].double(), weight))
    return r2.scores()


def all_layers(rows_by_layer: torch.Tensor, rows: slice) -> torch.Tensor:
    """Every layer's rows side by side. [layers, n, width] -> [n, layers * width]."""
    part = rows_by_layer[:, rows]
    return part.permute(1, 0, 2).reshape(part.shape[1], -1)  # (L, N, W) -> (N, L*W)


def select_layers(scores: torch.Tensor, k: int) -> tuple[tuple[int, ...], ...]:
    """Top-k source layers per target layer (k capped at the source layer count), best first.

    scores: [target_layers, source_layers]
    """
    k = max(1, min(k, scores.shape[1]))
    top = torch.topk(scores, k, dim=1).indices
    return tuple(tuple(int(i) for i in row) for row in top)
