"""The ridge map on planted relations: closed form, layer selection, and RoPE-free position generalisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.offline.calibration import fit_store
from agentkv.handoff.offline.collect import collect_from_caches
from agentkv.handoff.offline.config import CalibrationConfig
from agentkv.handoff.offline.linalg import RidgeAccumulator
from agentkv.handoff.rope import RopeTable
from agentkv.handoff.signature import ModelSignature, SignaturePair
from agentkv.handoff.offline.testing import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield


HEADS, DIM = 2, 16
WIDTH = HEADS * DIM


def rope(theta: float) -> RopeTable:
    return RopeTable(1.0 / (theta ** (torch.arange(0, DIM, 2, dtype=torch.float) / DIM)))


SOURCE_ROPE, TARGET_ROPE = rope(10_000.0), rope(1_000_000.0)


def signature(layers: int, name: str, theta: float) -> ModelSignature:
    return ModelSignature(layers, HEADS, DIM, theta, (("rope_type", "default"),), name)


def to_heads(rows: torch.Tensor) -> torch.Tensor:
    """[seq, heads*dim] -> [1, heads, seq, dim]."""
    return rows.reshape(1, rows.shape[0], HEADS, DIM).permute(0, 2, 1, 3)


class Planted:
    """Source layers of random position-free KV; target layer t = Σ A · (planted source layers) + noise."""

    def __init__(self, source_layers: int, plan: list[tuple[int, ...]], noise: float = 1e-3, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.source_layers, self.plan, self.noise = source_layers, plan, noise
        self.maps = {(kind, t, s): torch.randn(WIDTH, WIDTH, generator=self.gen) / WIDTH**0.5
                     for kind in ("k", "v") for t, chosen in enumerate(plan) for s in chosen}
        self.pair = SignaturePair(signature(source_layers, "src", 1e4), signature(len(plan), "tgt", 1e6))

    def target_rows(self, kind: str, source: list[torch.Tensor], seq: int) -> list[torch.Tensor]:
        return [sum(source[s] @ self.maps[(kind, t, s)] for s in chosen)
                + self.noise * torch.randn(seq, WIDTH, generator=self.gen) for t, chosen in enumerate(self.plan)]

    def caches(self, seq: int) -> tuple[KVCache, KVCache]:
        pos = torch.arange(seq).unsqueeze(0)
        src = {kind: [torch.randn(seq, WIDTH, generator=self.gen) for _ in range(self.source_layers)] for kind in "kv"}
        tgt = {kind: self.target_rows(kind, src[kind], seq) for kind in "kv"}
        made = []
        for side, table, sig in ((src, SOURCE_ROPE, self.pair.source), (tgt, TARGET_ROPE, self.pair.target)):
            keys = [table.apply(to_heads(r), pos) for r in side["k"]]
            made.append(KVCache.from_layers(keys, [to_heads(r) for r in side["v"]], sig, pos))
        return made[0], made[1]

    def fit(self, seq: int, count: int, k: int, strip: bool = True):
        store = collect_from_caches([self.caches(seq) for _ in range(count)], SOURCE_ROPE, TARGET_ROPE, strip=strip)
        config = CalibrationConfig(k=k, strip_rope=strip)
        return fit_store(store, self.pair, SOURCE_ROPE, TARGET_ROPE, config=config)


def relative_error(mapped: KVCache, true: KVCache) -> float:
    num = sum(float((m - t).pow(2).sum()) for m, t in zip(mapped.keys, true.keys, strict=True))
    return (num / sum(float(t.pow(2).sum()) for t in true.keys)) ** 0.5


def test_streamed_closed_form_matches_lstsq_on_the_augmented_system() -> None:
    """Ridge from three streamed chunks equals numpy's lstsq on [[X, 1], [√λ·I, 0]] to 1e-6."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 12)) * 3.0 + 5.0
    y = x @ rng.normal(size=(12, 4)) + rng.normal(size=(300, 4)) + 2.0
    lam = 0.5
    acc = RidgeAccumulator(12, 4)
    for part in np.array_split(np.arange(300), 3):
        acc.update(torch.from_numpy(x[part]), torch.from_numpy(y[part]))
    weight, bias = acc.solve(lam)
    design = np.vstack([np.hstack([x, np.ones((300, 1))]), np.hstack([np.sqrt(lam) * np.eye(12), np.zeros((12, 1))])])
    solution = np.linalg.lstsq(design, np.vstack([y, np.zeros((12, 4))]), rcond=None)[0]
    np.testing.assert_allclose(weight.numpy(), solution[:12], atol=1e-6)
    np.testing.assert_allclose(bias.numpy(), solution[12], atol=1e-6)


def test_planted_layers_are_selected_and_fitted() -> None:
    """When target layers are linear in known source layers, ranking picks exactly those and held-out R² > 0.99."""
    plan = [(1, 4), (0, 5), (2, 3)]
    mapper = Planted(source_layers=6, plan=plan).fit(seq=64, count=10, k=2)
    assert [set(chosen) for chosen in mapper.geometry.selected] == [set(p) for p in plan]
    r2 = mapper.info["calibration"]["heldout_r2"]
    assert min(r2["keys"] + r2["values"]) > 0.99


def test_stripped_map_generalises_from_64_to_2048_positions() -> None:
    """Fitted at 64 tokens, the RoPE-free map is as accurate at 2048; fitted on post-RoPE keys it is not."""
    planted = Planted(source_layers=2, plan=[(0,), (1,)], noise=1e-3)
    short, long = planted.caches(64), planted.caches(2048)
    errors = {}
    for strip in (True, False):
        mapper = planted.fit(seq=64, count=10, k=1, strip=strip)
        errors[strip] = [relative_error(mapper.map(src), tgt) for src, tgt in (short, long)]
    (strip_64, strip_2048), (raw_64, raw_2048) = errors[True], errors[False]
    assert strip_2048 < 0.01 and strip_2048 < 1.5 * strip_64
    assert raw_2048 > 20 * strip_2048 and raw_2048 > raw_64
