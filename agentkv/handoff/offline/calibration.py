"""Calibration: collect -> rank -> fit -> evaluate, for any backend whose factory has ``fit``.

    mapper = calibrate(source, target, sequences, backend="ridge", config=CalibrationConfig(k=8))
    mapper.save("mappers/small-to-large")

``fit_store`` starts from ready-made activations (tests plant relations there); ``calibrate`` runs the
two models, then evaluates the fitted map on the held-out sequences and records the figures the
quality gate reads.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from agentkv.handoff.offline.collect import ActivationStore, Progress, collect_from_models, heldout_count, no_progress
from agentkv.handoff.offline.config import CalibrationConfig
from agentkv.handoff.errors import HandoffError, SignatureMismatchError
from agentkv.handoff.learned import LearnedMapper
from agentkv.handoff.offline.linalg import R2Accumulator
from agentkv.handoff.mapping import KINDS, MapGeometry, gather_features
from agentkv.handoff.models import signature_of
from agentkv.handoff.offline.ranking import select_layers, single_layer_r2
from agentkv.handoff.registry import get_factory
from agentkv.handoff.rope import RopeTable
from agentkv.handoff.signature import SignaturePair


def fit_store(
    store: ActivationStore,
    pair: SignaturePair,
    source_rope: RopeTable,
    target_rope: RopeTable,
    *,
    backend: str = "ridge",
    config: CalibrationConfig = CalibrationConfig(),
    progress: Progress = no_progress,
) -> LearnedMapper:
    """Rank source layers per target layer, keep the top k, fit ``backend`` and record held-out R²."""
    fit = getattr(get_factory(backend), "fit", None)
    if fit is None:
        raise HandoffError(f"backend {backend!r} has nothing to calibrate")
    scores = single_layer_r2(store, config.lam, config.chunk_rows, progress)
    geometry = MapGeometry(pair, select_layers(scores, config.k), source_rope, target_rope, store.strip_rope)
    mapper = fit(store, geometry, config, progress)
    mapper.info["parameters"] = sum(p.numel() for p in mapper.params.values())
    figures = {"heldout_r2": heldout_r2(store, mapper, config.chunk_rows),
               "rank_r2": [[round(float(x), 6) for x in row] for row in scores]}
    mapper.info["calibration"] = figures
    return mapper


def heldout_r2(store: ActivationStore, mapper: LearnedMapper, chunk_rows: int) -> dict[str, list[float]]:
    """The fitted map's R² per target layer on held-out rows, in the space it was fitted in."""
    result: dict[str, list[float]] = {}
    for kind in KINDS:
        source, target = store.source(kind), store.target(kind)
        scores = []
        for layer, chosen in enumerate(mapper.geometry.selected):
            acc = R2Accumulator()
            for rows in store.chunks("heldout", chunk_rows):
                x = gather_features(source[:, rows].float(), chosen)
                acc.update(target[layer, rows], mapper.transform(mapper.params, layer, kind, x))
            scores.append(float(acc.scores()[0]))
        result[kind] = scores
    return result


def calibrate(
    source: Any,
    target: Any,
    sequences: Sequence[torch.Tensor],
    *,
    backend: str = "ridge",
    config: CalibrationConfig = CalibrationConfig(),
    progress: Progress = no_progress,
) -> LearnedMapper:
    """Fit a mapper from ``source`` to ``target`` on token sequences ([seq] or [batch, seq] each).

    The last ``heldout_fraction`` of the sequences are held out: they rank layers, stop MLP training
    and give the evaluation figures stored with the mapper. Models whose signatures name different
    tokenizers are refused (:class:`SignatureMismatchError`): the same ids would be different text.
    """
    from agentkv.handoff.offline.evaluation import evaluate

    pair = SignaturePair(signature_of(source), signature_of(target))
    refused = pair.source.tokenizer_mismatch(pair.target)
    if refused is not None:
        raise SignatureMismatchError(f"source and target do not share token ids, so no map between them: {refused}")
    store = collect_from_models(source, target, sequences, heldout_fraction=config.heldout_fraction,
                                strip=config.strip_rope, dtype=getattr(torch, config.store_dtype), progress=progress)
    ropes = RopeTable.from_model(source), RopeTable.from_model(target)
    mapper = fit_store(store, pair, *ropes, backend=backend, config=config, progress=progress)
    heldout = list(sequences)[len(sequences) - heldout_count(len(sequences), config.heldout_fraction):]
    figures = evaluate(mapper, source, target, heldout or list(sequences),
                       decode_tokens=config.eval_decode_tokens, progress=progress)
    return mapper.with_evaluation({**figures.to_dict(), "heldout": bool(heldout)})
