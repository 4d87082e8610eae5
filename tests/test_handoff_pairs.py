"""Real model pairs: a model onto itself, a depth-upscaled relative, and an unrelated model."""

from __future__ import annotations

import pytest
import torch

from agentkv.handoff import CalibrationConfig, calibrate, choose_handoff
from agentkv.handoff.offline.collect import prefill_cache
from agentkv.handoff.offline.evaluation import attention_scales, causal_attention, prefill_with_queries
from agentkv.handoff.models import attention_modules, forward_with_cache
from agentkv.handoff.offline.testing import damp_residual_writes, depth_upscaled, random_sequences, tiny_qwen3, torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield


SEQUENCES = random_sequences(10, 64)
CONFIG = CalibrationConfig(k=4)


@pytest.fixture(scope="module")
def source():
    return damp_residual_writes(tiny_qwen3(seed=0), 0.25)


@pytest.fixture(scope="module")
def self_mapper(source):
    return calibrate(source, source, SEQUENCES, config=CONFIG)


@torch.no_grad()
def greedy(model, cache, last: torch.Tensor, steps: int) -> list[int]:
    dynamic, token, out = cache.to_dynamic_cache(), last, []
    for _ in range(steps):
        token = forward_with_cache(model, token, dynamic).logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(token))
    return out


def test_captured_queries_reproduce_the_models_attention(source) -> None:
    """Hooked queries attending over the true cache give exactly what the model feeds its o_proj."""
    seen: list[torch.Tensor] = []
    hooks = [a.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
             for a in attention_modules(source)]
    cache, queries = prefill_with_queries(source, SEQUENCES[0].unsqueeze(0))
    for hook in hooks:
        hook.remove()
    for layer, (q, scale) in enumerate(zip(queries, attention_scales(source), strict=True)):
        ours = causal_attention(q, cache.keys[layer], cache.values[layer], scale)  # (B, Hq, T, D)
        theirs = seen[layer].reshape(1, 64, 4, 16).transpose(1, 2)  # (B, T, Hq*D) -> (B, Hq, T, D)
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_self_pair_is_near_identity(source, self_mapper) -> None:
    """A→A picks each layer for itself with a near-identity block and attention cosine above 0.999."""
    assert [chosen[0] for chosen in self_mapper.geometry.selected] == [0, 1, 2, 3]
    for layer in range(4):
        block = self_mapper.params[f"keys.{layer}.weight"][:32]  # rows of the best (own) source layer
        assert torch.allclose(block, torch.eye(32), atol=1e-2)
    assert self_mapper.attention_cosine > 0.999


def test_self_pair_decodes_like_its_own_prefill(source, self_mapper) -> None:
    """The target decodes the same greedy tokens from the mapped cache as from its own prefill."""
    tokens = random_sequences(1, 97, seed=7)[0].unsqueeze(0)
    own = prefill_cache(source, tokens[:, :-1])
    mapped = self_mapper.map(own)
    assert greedy(source, mapped, tokens[:, -1:], 12) == greedy(source, own, tokens[:, -1:], 12)


def test_depth_upscaled_relative_passes_the_gate(source) -> None:
    """A target built from the source's layers, duplicated and perturbed, maps well enough to be used."""
    target = depth_upscaled(source, order=(0, 1, 2, 1, 2, 3), noise=0.05)
    mapper = calibrate(source, target, SEQUENCES, config=CONFIG)
    plan = choose_handoff(mapper, 0.95)
    assert not plan.replay and plan.backend == "ridge", plan.reason
    assert mapper.info["evaluation"]["greedy_agreement"] >= 0.75


def test_unrelated_pair_fails_the_gate_and_falls_back_to_replay(source) -> None:
    """Two independent random models do not map: the gate refuses and the plan replays tokens."""
    other = damp_residual_writes(tiny_qwen3(seed=5), 0.25)
    mapper = calibrate(source, other, SEQUENCES, config=CONFIG)
    assert mapper.attention_cosine < 0.5
    plan = choose_handoff(mapper, 0.95)
    assert plan.replay and plan.fallback and "attention cosine" in plan.reason


def test_mapping_keeps_the_caches_dtype(source, self_mapper) -> None:
    """A bfloat16 cache maps to a bfloat16 cache that agrees with the float32 mapping to bf16 precision."""
    cache = prefill_cache(source, SEQUENCES[0].unsqueeze(0))
    half = self_mapper.map(cache.to(dtype=torch.bfloat16))
    full = self_mapper.map(cache)
    assert all(k.dtype == torch.bfloat16 for k in (*half.keys, *half.values))
    for a, b in zip(half.keys, full.keys, strict=True):
        assert torch.allclose(a.float(), b, atol=0.05, rtol=0.02)
