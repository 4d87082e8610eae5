"""Closed-form ridge regression from streamed sufficient statistics, and R², all in float64.

    acc = RidgeAccumulator(in_dim=1024, out_dim=1024)
    for x, y in batches:          # x: [n, in_dim], y: [n, out_dim]
        acc.update(x, y)
    weight, bias = acc.solve(lam=0.01)   # y ≈ x @ weight + bias
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class RidgeAccumulator:
    """Running ``n``, column sums, ``XᵀX`` and ``XᵀY`` of shifted data, in float64.

    The first batch's column means are subtracted from every batch (a fixed shift) so the Gram stays
    well conditioned even when features are far from zero; the shift cancels out in :meth:`solve`.
    """

    def __init__(self, in_dim: int, out_dim: int, device: torch.device | str | None = None) -> None:
        f64 = torch.float64
        self.n = 0
        self.shift_x = torch.zeros(in_dim, dtype=f64, device=device)
        self.shift_y = torch.zeros(out_dim, dtype=f64, device=device)
        self.sum_x = torch.zeros(in_dim, dtype=f64, device=device)
        self.sum_y = torch.zeros(out_dim, dtype=f64, device=device)
        self.xtx = torch.zeros(in_dim, in_dim, dtype=f64, device=device)
        self.xty = torch.zeros(in_dim, out_dim, dtype=f64, device=device)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows. x: [n, in_dim], y: [n, out_dim]."""
        x = x.to(self.xtx.device, torch.float64)
        y = y.to(self.xtx.device, torch.float64)
        if self.n == 0:
            self.shift_x, self.shift_y = x.mean(0), y.mean(0)
        x, y = x - self.shift_x, y - self.shift_y
        self.n += x.shape[0]
        self.sum_x += x.sum(0)
        self.sum_y += y.sum(0)
        self.xtx.addmm_(x.T, x)
        self.xty.addmm_(x.T, y)

    def solve(self, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean-centred ridge: ``W = (XcᵀXc + λI)⁻¹ XcᵀYc``, ``b = ȳ - x̄ W``. -> weight [in, out], bias [out]."""
        if self.n == 0:
            raise ValueError("no rows were accumulated")
        mean_x, mean_y = self.sum_x / self.n, self.sum_y / self.n
        gram = self.xtx - self.n * torch.outer(mean_x, mean_x)
        cross = self.xty - self.n * torch.outer(mean_x, mean_y)
        gram.diagonal().add_(lam)
        weight = torch.linalg.solve(gram, cross)
        bias = (mean_y + self.shift_y) - (mean_x + self.shift_x) @ weight
        return weight, bias


@dataclass
class R2Accumulator:
    """Pooled R² over streamed rows: ``1 - Σ(y - ŷ)² / Σ(y - ȳ)²`` with ``ȳ`` per column.

    ``groups`` splits the columns into equal blocks (e.g. one per target layer) scored separately.
    """

    groups: int = 1
    n: int = 0
    sse: torch.Tensor | None = field(default=None, repr=False)
    sum_y: torch.Tensor | None = field(default=None, repr=False)
    sum_y2: torch.Tensor | None = field(default=None, repr=False)

    def update(self, y: torch.Tensor, pred: torch.Tensor) -> None:
        """Add rows. y, pred: [n, columns]."""
        y, pred = y.double(), pred.double()
        sse, sum_y, sum_y2 = ((y - pred) ** 2).sum(0), y.sum(0), (y * y).sum(0)
        if self.sse is None:
            self.sse, self.sum_y, self.sum_y2 = sse, sum_y, sum_y2
        else:
            self.sse, self.sum_y, self.sum_y2 = self.sse + sse, self.sum_y + sum_y, self.sum_y2 + sum_y2
        self.n += y.shape[0]

    def scores(self) -> torch.Tensor:
        """R² per group: [groups] float64."""
        assert self.sse is not None and self.sum_y is not None and self.sum_y2 is not None, "no rows"
        sst = self.sum_y2 - self.sum_y**2 / self.n  # per column
        sse = self.sse.reshape(self.groups, -1).sum(1)
        return 1.0 - sse / sst.reshape(self.groups, -1).sum(1).clamp_min(1e-30)

