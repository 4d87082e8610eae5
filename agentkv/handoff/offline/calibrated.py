"""A calibrated mapper between two checkpoint folders, fitted once and kept under a digest of what decides it.

What the real-vLLM tier, ``benchmarks/handoff_vllm.py`` and ``examples/vllm_handoff.py`` share: a ridge map
from the fast checkpoint to the slow one, fitted by :func:`~agentkv.handoff.offline.calibration.calibrate` on a slice of
the standard library's text. A changed checkpoint, corpus or setting fits anew; an unchanged one costs nothing.

    folder = ensure_calibrated(models.fast, models.slow, models.root / "mappers")
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from agentkv._support.build import built_once

__all__ = ["DEFAULT_CORPUS", "ensure_calibrated"]

DEFAULT_CORPUS = Path(os.__file__).parent / "json"
"""A few thousand tokens of plain Python text that every interpreter ships."""


def ensure_calibrated(source: str | Path, target: str | Path, root: str | Path, *, corpus: str | Path = DEFAULT_CORPUS,
                      backend: str = "ridge", k: int = 2, seq_len: int = 128, max_tokens: int = 2048) -> Path:
    """The mapper folder for ``source`` -> ``target`` (checkpoint folders), calibrating it first when absent."""
    spec = {"source": str(source), "target": str(target), "corpus": str(corpus), "backend": backend, "k": k,
            "seq_len": seq_len, "max_tokens": max_tokens, "source_config": _config(source),
            "target_config": _config(target), "format": 1}
    folder = Path(root) / hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    with built_once(folder, folder / "manifest.json") as needed:
        if needed:
            _calibrate(spec, folder)
    return folder


def _config(checkpoint: str | Path) -> str:
    path = Path(checkpoint) / "config.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _calibrate(spec: dict[str, object], folder: Path) -> None:
    from agentkv.handoff.offline.calibration import calibrate
    from agentkv.handoff.offline.config import CalibrationConfig
    from agentkv.handoff.offline.corpus import token_sequences
    from agentkv.handoff.models import load_spec

    source, codec = load_spec(str(spec["source"]))
    target, _ = load_spec(str(spec["target"]))
    sequences = token_sequences(str(spec["corpus"]), codec, int(str(spec["seq_len"])), int(str(spec["max_tokens"])))
    mapper = calibrate(source, target, sequences, backend=str(spec["backend"]),
                       config=CalibrationConfig(k=int(str(spec["k"])), eval_decode_tokens=1))
    mapper.info.update({"source_spec": str(spec["source"]), "target_spec": str(spec["target"]),
                        "corpus": str(spec["corpus"])})
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    mapper.save(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
