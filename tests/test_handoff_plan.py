"""The plug point and the quality gate: registry, entry points, and the pure handoff decision."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint

import pytest
from structlog.testing import capture_logs

from agentkv.handoff import (
    HandoffPlan,
    KVMapper,
    ModelSignature,
    NotMappableError,
    SignaturePair,
    UnknownMapperError,
    available_mappers,
    choose_handoff,
    create_mapper,
    get_factory,
    load_mapper,
    log_plan,
    register_mapper,
    registry,
    unregister_mapper,
)

SRC = ModelSignature(4, 2, 16, 1e6, (("rope_type", "default"),), "src")
TGT = ModelSignature(6, 2, 16, 1e6, (("rope_type", "default"),), "tgt")


@dataclass
class FakeMapper:
    """A third-party mapper: no base class, only the protocol's members."""

    cosine: float | None = 0.99
    name: str = "fake"

    @property
    def signature_pair(self) -> SignaturePair:
        return SignaturePair(SRC, TGT)

    @property
    def moves_kv(self) -> bool:
        return True

    @property
    def attention_cosine(self) -> float | None:
        return self.cosine

    def map(self, cache, target_positions=None):
        return cache

    def save(self, path) -> None:
        from agentkv.handoff.builtins import _write_manifest

        _write_manifest(path, {"backend": self.name})

    @classmethod
    def load(cls, path) -> FakeMapper:
        return cls()


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    registry.reset_registry()


def test_importing_the_package_does_not_import_torch() -> None:
    """``import agentkv.handoff`` stays light: no torch, transformers or numpy."""
    code = "import sys, agentkv.handoff; print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_builtins_are_registered() -> None:
    """replay, identity, ridge and mlp are available by name."""
    assert {"replay", "identity", "ridge", "mlp"} <= set(available_mappers())
    assert isinstance(create_mapper("identity"), KVMapper)


def test_a_registered_third_party_mapper_is_created_and_loaded(tmp_path) -> None:
    """A mapper registered by name is created by name and loaded from its directory by manifest."""
    register_mapper("fake", FakeMapper)
    assert isinstance(create_mapper("fake"), KVMapper)
    FakeMapper().save(tmp_path)
    assert isinstance(load_mapper(tmp_path), FakeMapper)
    unregister_mapper("fake")
    with pytest.raises(UnknownMapperError, match="fake"):
        get_factory("fake")


def test_entry_points_add_backends(monkeypatch) -> None:
    """A package's ``agentkv.mappers`` entry point makes its backend available by name."""
    point = EntryPoint("fake", f"{__name__}:FakeMapper", "agentkv.mappers")
    monkeypatch.setattr(registry, "entry_points", lambda group: [point] if group == "agentkv.mappers" else [])
    registry.reset_registry()
    assert get_factory("fake") is FakeMapper


def test_replay_cannot_map() -> None:
    """The replay backend has no map: asking it to map says to re-prefill."""
    with pytest.raises(NotMappableError, match="re-prefill"):
        create_mapper("replay").map(None)


@pytest.mark.parametrize(
    ("mapper", "expected", "reason"),
    [
        (None, "replay", "replay configured"),
        ("replay", "replay", "replay configured"),
        ("identity", "identity", ">="),
        (FakeMapper(0.99), "fake", ">="),
        (FakeMapper(0.90), "replay", "< min_attention_cosine"),
        (FakeMapper(None), "replay", "no held-out attention cosine"),
    ],
)
def test_choose_handoff(mapper, expected, reason) -> None:
    """The gate maps only with a measured cosine at or above the floor; everything else replays."""
    plan = choose_handoff(mapper, 0.95, source=SRC, target=TGT)
    assert plan.backend == expected and reason in plan.reason
    assert plan.replay == (expected == "replay")


def test_choose_handoff_refuses_other_models() -> None:
    """A good mapper for another target model is refused by signature before its cosine counts."""
    other = ModelSignature(6, 2, 16, 1e6, (("rope_type", "default"),), "someone-else")
    plan = choose_handoff(FakeMapper(0.999), 0.95, source=SRC, target=other)
    assert plan.replay and plan.fallback and "target does not match" in plan.reason


def test_log_plan_emits_a_warning_on_fallback() -> None:
    """A refused mapper is logged as a ``handoff.fallback`` warning with its reason."""
    with capture_logs() as logs:
        log_plan(choose_handoff(FakeMapper(0.5), 0.95), session="s1")
        log_plan(HandoffPlan("replay", "replay configured"))
    assert [(e["event"], e["log_level"]) for e in logs] == [("handoff.fallback", "warning"), ("handoff.plan", "info")]
    assert "0.5000 < min_attention_cosine" in logs[0]["reason"] and logs[0]["session"] == "s1"
