"""The mlp backend: trains deterministically and beats ridge where the relation is nonlinear."""

from __future__ import annotations

import pytest
import torch

from agentkv.handoff.offline.calibration import fit_store
from agentkv.handoff.offline.collect import ActivationStore
from agentkv.handoff.offline.config import CalibrationConfig, MLPConfig
from agentkv.handoff.rope import RopeTable
from agentkv.handoff.signature import ModelSignature, SignaturePair
from agentkv.handoff.offline.testing import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield


DIM = 16
ROPE = RopeTable(1.0 / (1e4 ** (torch.arange(0, DIM, 2, dtype=torch.float) / DIM)))
PAIR = SignaturePair(ModelSignature(1, 1, DIM, 1e4, (), "src"), ModelSignature(1, 1, DIM, 1e4, (), "tgt"))
CONFIG = CalibrationConfig(k=1, mlp=MLPConfig(hidden=64, lr=1e-2, max_epochs=20, batch_size=200, patience=8))


def nonlinear_store(rows: int = 1200, seed: int = 0) -> ActivationStore:
    """One source and one target layer with target = (x A)² per column: no linear signal at all."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(DIM, DIM, generator=gen) / DIM**0.5
    x = {kind: torch.randn(1, rows, DIM, generator=gen) for kind in "kv"}
    y = {kind: (x[kind] @ a) ** 2 for kind in "kv"}
    return ActivationStore(x["k"], x["v"], y["k"], y["v"], n_train=int(rows * 0.8), strip_rope=False)


def test_mlp_beats_ridge_on_a_nonlinear_relation() -> None:
    """On a planted nonlinear relation the MLP's held-out R² clearly exceeds ridge's."""
    store = nonlinear_store()
    scores = {}
    for backend in ("ridge", "mlp"):
        mapper = fit_store(store, PAIR, ROPE, ROPE, backend=backend, config=CONFIG)
        r2 = mapper.info["calibration"]["heldout_r2"]
        scores[backend] = min(r2["keys"] + r2["values"])
    assert scores["ridge"] < 0.1 and scores["mlp"] > 0.7, scores


def test_mlp_training_is_deterministic_and_round_trips(tmp_path) -> None:
    """Two fits with the same seed give identical weights, and save/load keeps them bit-exact."""
    from agentkv.handoff import load_mapper

    store = nonlinear_store(rows=500)
    config = CalibrationConfig(k=1, mlp=MLPConfig(hidden=16, max_epochs=5, patience=2))
    first, second = (fit_store(store, PAIR, ROPE, ROPE, backend="mlp", config=config) for _ in range(2))
    assert all(torch.equal(first.params[n], second.params[n]) for n in first.params)
    first.save(tmp_path)
    loaded = load_mapper(tmp_path)
    assert loaded.name == "mlp" and all(torch.equal(loaded.params[n], first.params[n]) for n in first.params)
