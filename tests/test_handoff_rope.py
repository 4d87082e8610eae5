"""RoPE handling: strip and apply with each model's own rotary module, scaled variants included."""

from __future__ import annotations

import pytest
import torch

from agentkv.handoff.offline.collect import prefill_cache
from agentkv.handoff.rope import RopeTable, apply_rope, model_cos_sin, strip_rope
from agentkv.handoff.signature import ModelSignature
from agentkv.handoff.offline.testing import tiny_llama3, tiny_qwen3, torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield


MODELS = {"qwen3-default": tiny_qwen3, "llama3-scaled": tiny_llama3}


@pytest.fixture(params=sorted(MODELS), scope="module")
def model(request: pytest.FixtureRequest):
    return MODELS[request.param](seed=0)


def positions(n: int) -> torch.Tensor:
    return torch.arange(n).unsqueeze(0)


def test_llama3_scaling_is_active() -> None:
    """The llama3 config's rotary module really uses scaled frequencies, so the tests below cover scaling."""
    scaled = RopeTable.from_model(tiny_llama3()).inv_freq
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    assert not torch.allclose(scaled, plain)
    assert ModelSignature.from_config(tiny_llama3().config).rope_type == "llama3"


def test_rope_table_reproduces_the_module_bit_for_bit(model) -> None:
    """A RopeTable read from a model gives exactly the cos/sin of the model's own rotary module."""
    pos = positions(8192)
    table_cos, table_sin = RopeTable.from_model(model).cos_sin(pos)
    module_cos, module_sin = model_cos_sin(model, pos)
    assert torch.equal(table_cos, module_cos) and torch.equal(table_sin, module_sin)


def test_strip_then_apply_round_trips(model) -> None:
    """Stripping then re-applying RoPE with the model's cos/sin returns the input to 1e-5, out to 8K positions."""
    cos, sin = model_cos_sin(model, positions(8192))
    x = torch.randn(1, 2, 8192, 16)
    assert torch.allclose(apply_rope(strip_rope(x, cos, sin), cos, sin), x, atol=1e-5)


def test_apply_then_strip_round_trips(model) -> None:
    """Applying then stripping RoPE returns the position-free keys to 1e-5."""
    cos, sin = model_cos_sin(model, positions(8192))
    x = torch.randn(1, 2, 8192, 16)
    assert torch.allclose(strip_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5)


def test_cached_keys_are_rotations_of_position_free_keys(model) -> None:
    """A real cache's keys, stripped and re-applied through a RopeTable, come back to 1e-5."""
    cache = prefill_cache(model, torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0)))
    table = RopeTable.from_model(model)
    for keys in cache.keys:
        assert torch.allclose(table.apply(table.strip(keys, cache.positions), cache.positions), keys, atol=1e-5)


def test_dynamic_rope_types_are_refused() -> None:
    """A rope type whose frequencies depend on sequence length cannot be stored in a RopeTable."""
    model = tiny_qwen3(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        RopeTable.from_model(model)
