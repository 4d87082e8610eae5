"""Saved mappers: bit-exact round trips, plain-data files, and refusal of the wrong models."""

from __future__ import annotations

import json

import pytest
import torch

from agentkv.handoff import (
    CalibrationConfig,
    MapperFileError,
    SignatureMismatchError,
    calibrate,
    load_mapper,
)
from agentkv.handoff.offline.collect import prefill_cache
from agentkv.handoff.ridge import RidgeMapper
from agentkv.handoff.offline.testing import random_sequences, tiny_qwen3, torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield



@pytest.fixture(scope="module")
def pair():
    return tiny_qwen3(seed=0, layers=3), tiny_qwen3(seed=1, layers=4)


@pytest.fixture(scope="module")
def mapper(pair):
    return calibrate(*pair, random_sequences(6, 48), config=CalibrationConfig(k=2, eval_decode_tokens=2))


def test_save_load_round_trip_is_bit_exact(tmp_path, pair, mapper) -> None:
    """Weights, rope tables, selection and mapped outputs survive save/load unchanged."""
    mapper.save(tmp_path)
    loaded = load_mapper(tmp_path, source=pair[0], target=pair[1])
    assert isinstance(loaded, RidgeMapper)
    assert loaded.params.keys() == mapper.params.keys()
    assert all(torch.equal(loaded.params[n], p) for n, p in mapper.params.items())
    assert loaded.geometry.selected == mapper.geometry.selected
    assert loaded.geometry.target_rope.equals(mapper.geometry.target_rope)
    assert loaded.attention_cosine == mapper.attention_cosine
    cache = prefill_cache(pair[0], random_sequences(1, 40, seed=3)[0].unsqueeze(0))
    for a, b in zip(loaded.map(cache).keys, mapper.map(cache).keys, strict=True):
        assert torch.equal(a, b)


def test_manifest_is_plain_json_with_the_figures(tmp_path, mapper) -> None:
    """The manifest names backend, signatures, k, λ, selection, calibration size and evaluation figures."""
    mapper.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["backend"] == "ridge" and manifest["k"] == 2 and manifest["lam"] == 0.01
    assert manifest["signatures"]["target"]["num_layers"] == 4
    assert len(manifest["selected_layers"]) == 4 and manifest["calibration_tokens"] > 0
    assert set(manifest["evaluation"]) >= {"attention_cosine", "key_r2", "greedy_agreement", "mean_kl"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "weights.safetensors"]


def test_loading_for_other_models_is_refused(tmp_path, pair, mapper) -> None:
    """load_mapper with a source or target model other than the calibrated ones raises."""
    mapper.save(tmp_path)
    with pytest.raises(SignatureMismatchError, match="source"):
        load_mapper(tmp_path, source=pair[1], target=pair[1])
    with pytest.raises(SignatureMismatchError, match="model"):
        load_mapper(tmp_path, source=pair[0], target=tiny_qwen3(seed=9, layers=4))


def test_mapping_another_models_cache_is_refused(mapper) -> None:
    """A cache with another geometry, or the same geometry from another model, is refused clearly."""
    for stranger in (tiny_qwen3(seed=0, layers=2), tiny_qwen3(seed=4, layers=3)):
        cache = prefill_cache(stranger, random_sequences(1, 16)[0].unsqueeze(0))
        with pytest.raises(SignatureMismatchError, match="refusing a cache from another model"):
            mapper.map(cache)


def test_a_directory_of_another_backend_is_refused(tmp_path, mapper) -> None:
    """Loading a ridge directory as an mlp mapper fails on the manifest's backend field."""
    from agentkv.handoff.mlp import MLPMapper

    mapper.save(tmp_path)
    with pytest.raises(MapperFileError, match="not 'mlp'"):
        MLPMapper.load(tmp_path)
