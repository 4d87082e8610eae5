"""The calibrate / evaluate / bench commands, driven the way ``agentkv.cli`` dispatches them."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from agentkv.handoff.offline import cli
from agentkv.handoff.offline.testing import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded (and do not fight other jobs for shared cores)."""
    with torch_threads(1):
        yield



def run(command: str, *argv: str) -> int:
    """Parse and run one subcommand exactly as the top-level dispatcher does."""
    parser = argparse.ArgumentParser()
    getattr(cli, f"add_{command}_arguments")(parser)
    return getattr(cli, f"run_{command}")(parser.parse_args(list(argv)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small locally generated text corpus."""
    rng = random.Random(0)
    words = ["agent", "tool", "call", "cache", "prefix", "token", "layer", "head", "value", "key", "model",
             "fast", "slow", "result", "error"]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(120)))
    return str(path)


def test_calibrate_writes_a_mapper_and_evaluate_prints_it(tmp_path, corpus, capsys) -> None:
    """`calibrate` fits and saves an embedded-model mapper; `evaluate DIR` prints its figures and gate verdict."""
    out = tmp_path / "mapper"
    assert run("calibrate", "--source", "tiny", "--target", "tiny", "--corpus", corpus, "--out", str(out),
               "--seq-len", "64", "--max-tokens", "384", "--k", "1", "--decode-tokens", "1") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source_spec"] == "tiny" and manifest["evaluation"]["attention_cosine"] > 0.99
    capsys.readouterr()
    assert run("evaluate", str(out), "--min-attention-cosine", "0.9") == 0
    printed = capsys.readouterr().out
    assert "attention-output cosine" in printed and "map (min_attention_cosine 0.90)" in printed
    assert "per target layer" in printed


def test_bench_handoff_prints_map_and_prefill_times(capsys) -> None:
    """`bench handoff` prints a row of map ms, re-prefill ms and their ratio per length."""
    assert run("bench", "handoff", "--source", "tiny", "--target", "tiny", "--lengths", "32", "--repeats", "1") == 0
    printed = capsys.readouterr().out
    assert "re-prefill ms" in printed and "│     32 │" in printed
