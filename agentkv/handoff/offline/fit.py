"""Fitting the learned mappers (offline): ``ridge`` solved in closed form from streamed statistics, ``mlp`` trained
with Adam and early stopping. The runtime mapper classes (:class:`~agentkv.handoff.ridge.RidgeMapper`,
:class:`~agentkv.handoff.mlp.MLPMapper`) hold and apply the result; their ``fit`` comes here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agentkv.handoff.learned import Params, each_map
from agentkv.handoff.mapping import MapGeometry, gather_features
from agentkv.handoff.offline.collect import ActivationStore, Progress, no_progress
from agentkv.handoff.offline.config import CalibrationConfig, MLPConfig
from agentkv.handoff.offline.linalg import RidgeAccumulator

__all__ = ["fit_layer", "fit_mlp", "fit_ridge", "fold_scaling", "layer_data", "train_mlp"]


def fit_ridge(cls: Any, store: ActivationStore, geometry: MapGeometry, config: CalibrationConfig | None = None,
              progress: Progress | None = None) -> Any:
    """A ``cls`` (:class:`~agentkv.handoff.ridge.RidgeMapper`) with every target layer's key and value map solved
    on the store's train split."""
    config = config or CalibrationConfig()
    progress = progress or no_progress
    params: Params = {}
    for layer, chosen, kind in each_map(geometry.selected, progress):
        weight, bias = fit_layer(store, chosen, layer, kind, config)
        params[f"{kind}.{layer}.weight"], params[f"{kind}.{layer}.bias"] = weight.float(), bias.float()
    info = {"k": len(geometry.selected[0]), "lam": config.lam, "calibration_tokens": store.n_train}
    return cls(geometry, params, info)


def fit_layer(
    store: ActivationStore, chosen: tuple[int, ...], layer: int, kind: str, config: CalibrationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream the train split into one float64 accumulator and solve. -> weight [k*W, W], bias [W] (float64)."""
    source, target = store.source(kind), store.target(kind)
    acc = RidgeAccumulator(len(chosen) * source.shape[2], target.shape[2])
    for rows in store.chunks("train", config.chunk_rows):
        acc.update(gather_features(source[:, rows], chosen), target[layer, rows])
    return acc.solve(config.lam)


def fit_mlp(cls: Any, store: ActivationStore, geometry: MapGeometry, config: CalibrationConfig | None = None,
            progress: Progress | None = None) -> Any:
    """A ``cls`` (:class:`~agentkv.handoff.mlp.MLPMapper`) with every target layer's key and value MLP trained on the
    train split, stopping on held-out loss."""
    config = config or CalibrationConfig()
    progress = progress or no_progress
    params: Params = {}
    epochs: list[int] = []
    for layer, chosen, kind in each_map(geometry.selected, progress):
        x_tr, y_tr, x_ho, y_ho = layer_data(store, chosen, layer, kind)
        net, best_epoch = train_mlp(x_tr, y_tr, x_ho, y_ho, config.mlp)
        params.update({f"{kind}.{layer}.{n}": t for n, t in net.items()})
        epochs.append(best_epoch)
    mlp = config.mlp
    info = {"k": len(geometry.selected[0]), "calibration_tokens": store.n_train,
            "mlp": {"hidden": mlp.hidden, "lr": mlp.lr, "batch_size": mlp.batch_size, "seed": mlp.seed,
                    "best_epochs": epochs}}
    return cls(geometry, params, info)


def layer_data(
    store: ActivationStore, chosen: tuple[int, ...], layer: int, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and held-out features/targets of one target layer: x [n, k*W], y [n, W] (float32)."""
    source, target = store.source(kind).float(), store.target(kind).float()
    train, heldout = store.split("train"), store.split("heldout")
    return (gather_features(source[:, train], chosen), target[layer, train],
            gather_features(source[:, heldout], chosen), target[layer, heldout])


def train_mlp(
    x: torch.Tensor, y: torch.Tensor, x_ho: torch.Tensor, y_ho: torch.Tensor, config: MLPConfig
) -> tuple[Params, int]:
    """Adam on standardised data; returns the best held-out epoch's weights with the scaling folded in."""
    gen = torch.Generator().manual_seed(config.seed)
    x_mean, x_std = x.mean(0), x.std(0).clamp_min(1e-6)
    y_mean, y_std = y.mean(0), y.std(0).clamp_min(1e-6)
    xs, ys, xh, yh = (x - x_mean) / x_std, (y - y_mean) / y_std, (x_ho - x_mean) / x_std, (y_ho - y_mean) / y_std
    net = make_net(x.shape[1], config.hidden or y.shape[1], y.shape[1], gen)
    opt = torch.optim.Adam(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    best, best_state, best_epoch, waited = float("inf"), _state(net), 0, 0
    for epoch in range(config.max_epochs):
        run_epoch(net, opt, xs, ys, config.batch_size, gen)
        loss = held_out_loss(net, xh, yh)
        if loss < best - 1e-7:
            best, best_state, best_epoch, waited = loss, _state(net), epoch + 1, 0
        else:
            waited += 1
        if waited >= config.patience:
            break
    return fold_scaling(best_state, x_mean, x_std, y_mean, y_std), best_epoch


def make_net(in_dim: int, hidden: int, out_dim: int, gen: torch.Generator) -> nn.Sequential:
    """linear -> GELU -> linear, initialised from ``gen``."""
    net = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))
    with torch.no_grad():
        for linear in (net[0], net[2]):
            bound = linear.in_features**-0.5
            linear.weight.uniform_(-bound, bound, generator=gen)
            linear.bias.zero_()
    return net


def run_epoch(
    net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, batch: int, gen: torch.Generator
) -> None:
    """One shuffled pass of mean-squared-error steps."""
    order = torch.randperm(x.shape[0], generator=gen)
    for start in range(0, x.shape[0], batch):
        idx = order[start:start + batch]
        opt.zero_grad()
        nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
        opt.step()


@torch.no_grad()
def held_out_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error on held-out rows."""
    return float(nn.functional.mse_loss(net(x), y))


def _state(net: nn.Sequential) -> Params:
    return {"w1": net[0].weight.detach().clone(), "b1": net[0].bias.detach().clone(),
            "w2": net[2].weight.detach().clone(), "b2": net[2].bias.detach().clone()}


def fold_scaling(state: Params, x_mean: torch.Tensor, x_std: torch.Tensor,
                 y_mean: torch.Tensor, y_std: torch.Tensor) -> Params:
    """Weights that take raw x to raw y: ``w1/σx``, ``b1 - (w1/σx)·μx``, ``σy·w2``, ``σy·b2 + μy``."""
    w1 = state["w1"] / x_std  # (hidden, in) scaled per input column
    return {"w1": w1, "b1": state["b1"] - w1 @ x_mean,
            "w2": state["w2"] * y_std[:, None], "b2": state["b2"] * y_std + y_mean}
