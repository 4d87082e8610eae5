"""Fuzzing mapper directories: whatever the manifest or weights hold, only MapperFileError escapes, and what loads maps."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from agentkv.handoff import MapperFileError, load_mapper
from agentkv.handoff.errors import SignatureMismatchError
from agentkv.handoff.offline.testing import random_cache, random_learned

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MAPPERS = {name: random_learned(name) for name in ("ridge", "mlp")}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
    | st.sampled_from([-1, 0, 1, 2, 3, 99, 2**70, 1.5, "3", True]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON value, the root included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, (*prefix, index))
    return found


def mutated(manifest: Any, path: tuple[Any, ...], replacement: Any, delete: bool) -> Any:
    """``manifest`` with the value at ``path`` replaced (or deleted, where it is a dict key)."""
    if not path:
        return replacement
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return manifest


def load_and_map(files: dict[str, bytes]) -> None:
    """Write the directory, load it; if it loads, map a cache of its own source geometry (when small)."""
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        try:
            mapper = load_mapper(folder)
        except MapperFileError:
            return
    pair = mapper.signature_pair
    if pair is None or pair.source.num_layers * pair.source.kv_heads * pair.source.head_dim > 4096:
        return
    try:
        out = mapper.map(random_cache(pair.source, seq=3))
    except SignatureMismatchError:
        return
    assert len(out.keys) == pair.target.num_layers
    assert out.keys[0].shape == (1, pair.target.kv_heads, 3, pair.target.head_dim)


def saved(name: str) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as folder:
        MAPPERS[name].save(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


ORIGINAL = {name: saved(name) for name in MAPPERS}


@FUZZ
@given(st.sampled_from(sorted(MAPPERS)), st.data())
def test_fuzzed_manifests_raise_only_mapper_file_error(name: str, data: st.DataObject) -> None:
    """One to three random replacements or deletions anywhere in a valid manifest: load fails cleanly or maps."""
    manifest: Any = json.loads(ORIGINAL[name]["manifest.json"])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths(manifest)))
        manifest = mutated(manifest, path, data.draw(json_values), data.draw(st.booleans()))
    load_and_map({**ORIGINAL[name], "manifest.json": json.dumps(manifest).encode()})


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


@FUZZ
@given(st.sampled_from(sorted(MAPPERS)), st.data())
def test_fuzzed_tensors_raise_only_mapper_file_error(name: str, data: st.DataObject) -> None:
    """Random tensors added, dropped, reshaped or retyped in a valid weights file: load fails cleanly or maps."""
    tensors = dict(MAPPERS[name].params) | MAPPERS[name].geometry.rope_tensors()
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(tensors)) | st.text(min_size=1, max_size=12))
        if data.draw(st.booleans()) and key in tensors:
            del tensors[key]
            continue
        shape = data.draw(st.lists(st.integers(0, 40), max_size=3))
        tensors[key] = torch.zeros(shape, dtype=data.draw(st.sampled_from(DTYPES)))
    load_and_map({**ORIGINAL[name], "weights.safetensors": save(tensors)})


@FUZZ
@given(st.sampled_from(sorted(MAPPERS)), st.data())
def test_corrupted_weight_bytes_raise_only_mapper_file_error(name: str, data: st.DataObject) -> None:
    """Random byte overwrites (header included) and truncations of the weights file: load fails cleanly or maps."""
    blob = bytearray(ORIGINAL[name]["weights.safetensors"])
    header_end = 8 + int.from_bytes(blob[:8], "little")
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header_end + 16))
        blob[at:at + 1] = data.draw(st.binary(min_size=1, max_size=1))
    cut = data.draw(st.none() | st.integers(0, len(blob)))
    load_and_map({**ORIGINAL[name], "weights.safetensors": bytes(blob[:cut])})
