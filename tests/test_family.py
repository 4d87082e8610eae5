"""A trained family on the stdlib: micro recipe trained here, calibrated with ridge, gated on what it measures."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
httpx = pytest.importorskip("httpx")

from agentkv.cli import build_parser, main  # noqa: E402
from agentkv.handoff import choose_handoff, load_mapper  # noqa: E402
from agentkv.embedded.family import RECIPES, ensure_family, members  # noqa: E402
from agentkv.embedded.family.corpus import split_corpus, stdlib_files  # noqa: E402

pytestmark = pytest.mark.slow

CALIBRATION = ["--seq-len", "64", "--max-tokens", "8192", "--decode-tokens", "8", "--k", "2"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return ensure_family("micro", out=tmp_path_factory.mktemp("family"), progress=False)


@pytest.fixture(scope="module")
def mappers(family, tmp_path_factory):
    root = tmp_path_factory.mktemp("mappers")
    made = {}
    for name, source in (("related", family.small), ("unrelated", family.unrelated)):
        out = root / name
        main(["calibrate", "--source", str(source), "--target", str(family.large), "--corpus", str(family.corpus),
              "--out", str(out), "--backend", "ridge", *CALIBRATION])
        made[name] = load_mapper(out)
    return made


def test_every_member_learned_and_reports_heldout_loss(family):
    """Each micro member's held-out loss is well below a uniform guess over its vocabulary."""
    report = family.report()
    assert sorted(report) == sorted(m.name for m in members(RECIPES["micro"]))
    steps = {m.name: m.steps for m in members(RECIPES["micro"])}
    for name, info in report.items():
        assert info["heldout_loss"] < math.log(info["vocab_size"]) - 1.0
        assert info["steps"] == steps[name] and info["seconds"] > 0


def test_related_pair_maps_better_than_the_unrelated_pair(mappers):
    """Ridge on small -> large (same data, same seed) beats small-unrelated -> large in attention-output cosine."""
    related, unrelated = (mappers[name].attention_cosine for name in ("related", "unrelated"))
    assert related is not None and unrelated is not None
    assert related > unrelated


@pytest.mark.parametrize("floor_at", ["below both", "between", "above both"])
def test_gate_decisions_follow_the_measured_cosine(mappers, floor_at):
    """With the floor placed relative to the two measured cosines, each mapper maps exactly when it clears it."""
    related, unrelated = mappers["related"].attention_cosine, mappers["unrelated"].attention_cosine
    floor = {"below both": min(related, unrelated) - 1e-3, "between": (related + unrelated) / 2,
             "above both": max(related, unrelated) + 1e-3}[floor_at]
    for mapper in mappers.values():
        plan = choose_handoff(mapper, min_attention_cosine=floor)
        assert plan.replay == (mapper.attention_cosine < floor), plan.reason
    default = choose_handoff(mappers["related"])
    assert default.replay == (related < 0.95)


def test_different_tokenizer_pair_is_refused(family, tmp_path):
    """Calibrating small-othertok -> large stops at the signature check: the tokenizers differ."""
    with pytest.raises(SystemExit, match="tokenizer"):
        main(["calibrate", "--source", str(family.othertok), "--target", str(family.large), "--corpus",
              str(family.corpus), "--out", str(tmp_path / "refused"), *CALIBRATION])
    assert not (tmp_path / "refused").exists()


def test_a_trained_member_serves_chat(family):
    """`agentkv serve --model DIR/small` names the checkpoint, and the server answers a chat request from it."""
    from agentkv.embedded.server import LocalServer

    args = build_parser("serve").parse_args(["serve", "--model", str(family.small)])
    assert args.model_path == str(family.small)
    messages = [{"role": "user", "content": "def parse(text):"}]
    with LocalServer.from_pretrained(family.small, window=512, model_id="small") as server, \
            httpx.Client(base_url=server.base_url) as http:
        reply = http.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 8})
    body = reply.json()
    assert reply.status_code == 200 and isinstance(body["choices"][0]["message"]["content"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 8


def test_a_cached_family_is_not_retrained(family):
    """A second ensure_family on the same folder returns at once, leaving every checkpoint untouched."""
    before = {p: p.stat().st_mtime_ns for p in family.root.rglob("model.safetensors")}
    again = ensure_family("micro", out=family.root, progress=False)
    assert again == family
    assert {p: p.stat().st_mtime_ns for p in family.root.rglob("model.safetensors")} == before


def test_corpus_halves_are_disjoint_and_ordered():
    """The stdlib split is deterministic, its halves disjoint, and held-out files in neither."""
    files = stdlib_files()
    split = split_corpus(files, heldout_every=10, max_chars=1_000_000)
    assert files == stdlib_files() and split == split_corpus(files, heldout_every=10, max_chars=1_000_000)
    a, b, held = set(split.a), set(split.b), set(split.heldout)
    assert a and b and held and not (a & b) and not (held & (a | b))
    assert list(split.a) == sorted(split.a, key=files.index)


def test_the_demo_runs_on_the_trained_family(family, tmp_path, monkeypatch):
    """`agentkv demo --trained micro` serves the cached family (no retraining) and escalates onto a warm cache."""
    from agentkv.demo import runs
    from agentkv.embedded.family import family_root, resolve_recipe

    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    cached = family_root(resolve_recipe("micro"))
    cached.parent.mkdir(parents=True)
    cached.symlink_to(family.root, target_is_directory=True)
    config = runs.DemoConfig(**{**runs.DemoConfig.quick().__dict__, "trained": "micro", "max_turns": 24})
    warm, cold = runs.run_both(config)
    escalated = warm.escalation()
    assert escalated is not None and cold.escalation() is not None
    assert escalated.cached_tokens and escalated.cached_tokens > 0.5 * escalated.input_tokens
    assert not cold.escalation().cached_tokens
