"""Handoff between two local engines: the source's cached prefix lands in the target's prefix cache."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from agentkv.handoff import CalibrationConfig, calibrate, create_mapper, handoff_prefix
from agentkv.handoff.builtins import IdentityMapper
from agentkv.handoff.models import signature_of
from agentkv.handoff.offline.testing import random_sequences, torch_threads
from agentkv.embedded.engine import LocalEngine
from agentkv.embedded.engine.models import build_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield


PROMPT = [int(t) for t in random_sequences(1, 75, vocab=50_000, seed=3)[0]]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def engines(model) -> tuple[LocalEngine, LocalEngine, LocalEngine]:
    """A source that has served PROMPT, a cold target replica, and a cold reference replica."""
    source, target, reference = (LocalEngine(model, model_id=name) for name in ("src", "tgt", "ref"))
    source.generate(PROMPT, max_tokens=1, cache_salt="tenant")
    return source, target, reference


def test_identity_handoff_gives_the_target_its_own_prefill(model) -> None:
    """After an identity handoff the target reuses 64 mapped tokens and its logits equal a cold prefill."""
    source, target, reference = engines(model)
    result = handoff_prefix(source, target, PROMPT, IdentityMapper(signature_of(model)), cache_salt="tenant")
    assert result.mapped_tokens == 64 and result.backend == "identity" and result.bytes_moved > 0
    logits, cached = target.prefill_logits(PROMPT, cache_salt="tenant")
    expected, _ = reference.prefill_logits(PROMPT, cache_salt="tenant")
    assert cached == 64
    assert torch.allclose(logits, expected, atol=1e-5)


def test_ridge_handoff_is_installed_under_the_targets_salt(model) -> None:
    """A calibrated self-map installs blocks only under the requested salt, and the logits stay close."""
    mapper = calibrate(model, model, random_sequences(6, 48, vocab=50_000), config=CalibrationConfig(k=2))
    source, target, reference = engines(model)
    assert handoff_prefix(source, target, PROMPT, mapper, cache_salt="tenant").mapped_tokens == 64
    assert target.prefill_logits(PROMPT, cache_salt="other")[1] == 0
    logits, cached = target.prefill_logits(PROMPT, cache_salt="tenant")
    assert cached == 64
    expected = reference.prefill_logits(PROMPT, cache_salt="tenant")[0]
    assert torch.nn.functional.cosine_similarity(logits, expected, dim=0) > 0.999


def test_replay_moves_nothing(model) -> None:
    """The replay backend installs nothing: the target prefills every token itself."""
    source, target, _ = engines(model)
    result = handoff_prefix(source, target, PROMPT, create_mapper("replay"), cache_salt="tenant")
    assert result.replayed and result.backend == "replay"
    assert target.prefill_logits(PROMPT, cache_salt="tenant")[1] == 0


def test_a_refused_cache_falls_back_to_replay_with_an_event(model) -> None:
    """A mapper bound to another model refuses the cache; the handoff replays and logs why."""
    source, target, _ = engines(model)
    other = IdentityMapper(signature_of(build_model("tiny", seed=0, num_hidden_layers=3)))
    with capture_logs() as logs:
        result = handoff_prefix(source, target, PROMPT, other, cache_salt="tenant")
    assert result.replayed and "refused" in result.reason
    assert any(e["event"] == "handoff.fallback" and e["log_level"] == "warning" for e in logs)


def test_an_uncached_prefix_maps_nothing(model) -> None:
    """When the source has not served the prompt there is nothing to map."""
    source, target, _ = engines(model)
    result = handoff_prefix(source, target, PROMPT, IdentityMapper(), cache_salt="stranger")
    assert result.mapped_tokens == 0 and "no cached prefix" in result.reason
