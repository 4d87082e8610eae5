"""Loading a mapper directory checks every manifest field and tensor, and refuses anything else with MapperFileError."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentkv.handoff import MapperFileError, load_mapper
from agentkv.handoff.builtins import IdentityMapper
from agentkv.handoff.mlp import MLPMapper
from agentkv.handoff.ridge import RidgeMapper
from agentkv.handoff.offline.testing import TINY_SELECTED, TINY_SOURCE, random_cache, random_learned

def ridge() -> RidgeMapper:
    return random_learned("ridge")  # type: ignore[return-value]


def mlp() -> MLPMapper:
    return random_learned("mlp")  # type: ignore[return-value]


def edit_manifest(folder: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    result = change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest if result is None else result))


def edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(folder / "weights.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "weights.safetensors"))


def test_valid_files_round_trip_and_map(tmp_path: Path) -> None:
    """A correct ridge and mlp directory still loads, bit-exact, and maps a cache (the checks refuse nothing valid)."""
    for mapper in (ridge(), mlp()):
        mapper.save(tmp_path / mapper.name)
        loaded = load_mapper(tmp_path / mapper.name)
        assert type(loaded) is type(mapper) and loaded.geometry.selected == TINY_SELECTED
        assert all(torch.equal(loaded.params[n], p) for n, p in mapper.params.items())
        cache = random_cache(TINY_SOURCE)
        assert torch.equal(loaded.map(cache).keys[1], mapper.map(cache).keys[1])


MANIFEST_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "a JSON list": (lambda m: [m], "JSON list"),
    "null signatures": (lambda m: m.update(signatures=None), "'signatures'"),
    "null source signature": (lambda m: m["signatures"].update(source=None), "signatures.source"),
    "string num_layers": (lambda m: m["signatures"]["source"].update(num_layers="3"), "signatures.source.num_layers"),
    "zero kv_heads": (lambda m: m["signatures"]["target"].update(kv_heads=0), "signatures.target.kv_heads"),
    "unknown signature key": (lambda m: m["signatures"]["target"].update(hidden=7), "signatures.target"),
    "nested rope_scaling": (lambda m: m["signatures"]["source"].update(rope_scaling={"a": {"b": 1}}), "rope_scaling.a"),
    "layer 99": (lambda m: m["selected_layers"][0].__setitem__(0, 99), r"selected_layers\[0\]"),
    "layer -1": (lambda m: m["selected_layers"][1].__setitem__(1, -1), r"selected_layers\[1\]"),
    "layer as a float": (lambda m: m["selected_layers"][1].__setitem__(1, 1.0), r"selected_layers\[1\]"),
    "one selection short": (lambda m: m.update(selected_layers=m["selected_layers"][:-1]), "'selected_layers'"),
    "empty selection": (lambda m: m["selected_layers"].__setitem__(0, []), r"selected_layers\[0\]"),
    "string strip_rope": (lambda m: m.update(strip_rope="no"), "'strip_rope'"),
    "null attention_scaling": (lambda m: m.update(attention_scaling=None), "'attention_scaling'"),
    "NaN attention scaling": (lambda m: m["attention_scaling"].update(target=float("nan")), "attention_scaling.target"),
    "unregistered backend": (lambda m: m.update(backend="nonesuch"), "'backend'"),
    "format_version true": (lambda m: m.update(format_version=True), "'format_version'"),
    "string evaluation": (lambda m: m.update(evaluation="great"), "'evaluation'"),
    "string attention_cosine": (lambda m: m["evaluation"].update(attention_cosine="0.99"), "attention_cosine"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_a_malformed_manifest_field_is_named(tmp_path: Path, case: str) -> None:
    """Each malformed manifest field gives MapperFileError naming that field, from load_mapper and from the class."""
    change, field = MANIFEST_CASES[case]
    ridge().save(tmp_path)
    edit_manifest(tmp_path, change)
    for load in (load_mapper, RidgeMapper.load):
        with pytest.raises(MapperFileError, match=field):
            load(tmp_path)


@pytest.mark.parametrize("text", [b"{not json", b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000, b""],
                         ids=["invalid", "not-utf8", "nested-100k", "empty"])
def test_an_unreadable_manifest_is_a_mapper_file_error(tmp_path: Path, text: bytes) -> None:
    """Invalid JSON, bytes that are not UTF-8, JSON nested past the recursion limit and an empty file are refused."""
    ridge().save(tmp_path)
    (tmp_path / "manifest.json").write_bytes(text)
    with pytest.raises(MapperFileError, match="manifest.json"):
        load_mapper(tmp_path)


WEIGHT_CASES: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "missing tensor": (lambda t: t.pop("values.1.weight"), "lacks tensors \\['values.1.weight'\\]"),
    "extra tensor": (lambda t: t.update({"keys.9.weight": torch.zeros(1)}), "unexpected tensors \\['keys.9.weight'\\]"),
    "transposed weight": (lambda t: t.update({"keys.0.weight": t["keys.0.weight"].T.contiguous()}), "'keys.0.weight'"),
    "short bias": (lambda t: t.update({"values.1.bias": torch.zeros(3)}), "'values.1.bias'"),
    "rope table size": (lambda t: t.update({"rope.target.inv_freq": torch.ones(3)}), "'rope.target.inv_freq'"),
    "missing rope table": (lambda t: t.pop("rope.source.inv_freq"), "rope.source.inv_freq"),
    "float64 weight": (lambda t: t.update({"keys.1.weight": t["keys.1.weight"].double()}), "'keys.1.weight' has dtype F64"),
    "int64 bias": (lambda t: t.update({"keys.1.bias": torch.zeros(4, dtype=torch.int64)}), "'keys.1.bias' has dtype I64"),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_a_tensor_that_contradicts_the_manifest_is_named(tmp_path: Path, case: str) -> None:
    """A missing, extra, misshapen or wrongly typed tensor is refused at load, naming it, instead of failing in map()."""
    change, name = WEIGHT_CASES[case]
    ridge().save(tmp_path)
    edit_weights(tmp_path, change)
    with pytest.raises(MapperFileError, match=name):
        load_mapper(tmp_path)


def test_mlp_hidden_widths_must_agree(tmp_path: Path) -> None:
    """An mlp whose w2 disagrees with w1 on the hidden width is refused, naming w2."""
    mlp().save(tmp_path)
    edit_weights(tmp_path, lambda t: t.update({"keys.0.w2": torch.zeros(4, 6)}))
    with pytest.raises(MapperFileError, match="'keys.0.w2'"):
        load_mapper(tmp_path)


class _Exploit:
    """Unpickling this creates ``marker``: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_pickle_named_weights_safetensors_never_runs(tmp_path: Path) -> None:
    """A pickle posing as the weights file is a MapperFileError, and its payload never executes."""
    ridge().save(tmp_path / "mapper")
    marker = tmp_path / "pwned"
    (tmp_path / "mapper" / "weights.safetensors").write_bytes(pickle.dumps({"keys.0.weight": _Exploit(marker)}))
    with pytest.raises(MapperFileError, match="not a readable safetensors file"):
        load_mapper(tmp_path / "mapper")
    assert not marker.exists()


@pytest.mark.parametrize("keep", [0, 7, 100, -40])
def test_a_truncated_weights_file_is_a_mapper_file_error(tmp_path: Path, keep: int) -> None:
    """A weights file cut short (empty, inside the header length, inside the header, inside the data) is refused."""
    ridge().save(tmp_path)
    data = (tmp_path / "weights.safetensors").read_bytes()
    (tmp_path / "weights.safetensors").write_bytes(data[:keep])
    with pytest.raises(MapperFileError, match="not a readable safetensors file"):
        load_mapper(tmp_path)


@pytest.mark.parametrize("signature", ["abc", [1, 2], {"num_layers": 2}, {"num_layers": 2, "kv_heads": 1, "head_dim": 3}])
def test_an_identity_manifest_with_a_bad_signature_is_refused(tmp_path: Path, signature: Any) -> None:
    """The identity mapper's optional signature is type-checked like a learned mapper's."""
    IdentityMapper(TINY_SOURCE).save(tmp_path)
    edit_manifest(tmp_path, lambda m: m.update(signature=signature))
    with pytest.raises(MapperFileError, match="'signature"):
        load_mapper(tmp_path)
