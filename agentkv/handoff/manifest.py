"""A saved mapper's files, read defensively: every manifest field and every tensor header is checked first.

Pure functions of plain data (the parsed JSON, and the safetensors header as ``name -> (shape, dtype)``),
torch-free. Each failure is a :class:`MapperFileError` naming the field or the tensor at fault, so a
hand-edited or hostile directory is refused at load time rather than failing inside ``map()``.

    pair, selected, strip, scaling = geometry_fields(manifest, where="mappers/a")
    check_tensors(header, {**rope_shapes(pair), **param_shapes}, where="mappers/a")
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from agentkv.handoff.errors import MapperFileError
from agentkv.handoff.signature import ModelSignature, SignaturePair

Shape = tuple[int, ...]
Header = Mapping[str, tuple[Shape, str]]
"""A safetensors header: tensor name -> (shape, dtype string such as ``"F32"``)."""
Selected = tuple[tuple[int, ...], ...]

FLOAT32 = "F32"
_SIGNATURE_INTS = ("num_layers", "kv_heads", "head_dim")
_SIGNATURE_FIELDS = frozenset({*_SIGNATURE_INTS, "rope_theta", "rope_scaling", "model_id", "tokenizer"})


def fail(where: str, what: str) -> MapperFileError:
    """The error for a bad field or tensor of the mapper at ``where``."""
    return MapperFileError(f"{where}: {what}")


def is_int(value: Any) -> bool:
    """A JSON integer (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def manifest_object(data: Any, where: str) -> dict[str, Any]:
    """The manifest itself must be a JSON object."""
    if not isinstance(data, dict):
        raise fail(where, f"manifest.json holds a JSON {type(data).__name__}, not an object")
    return data


def check_backend(manifest: Mapping[str, Any], backend: str, version: int, where: str) -> None:
    """``backend`` names the loader's backend and ``format_version`` is the supported integer."""
    named = manifest.get("backend")
    if named != backend:
        raise fail(where, f"field 'backend' is {named!r}: this directory holds a {named!r} mapper, not {backend!r}")
    found = manifest.get("format_version")
    if not is_int(found) or found != version:
        raise fail(where, f"field 'format_version' is {found!r}: unsupported (expected {version})")


def signature(data: Any, field: str, where: str) -> ModelSignature:
    """A :class:`ModelSignature` from a manifest object, every field's type checked."""
    if not isinstance(data, dict):
        raise fail(where, f"field {field!r} must be an object, not {type(data).__name__}")
    unknown = sorted(set(data) - _SIGNATURE_FIELDS)
    missing = sorted({*_SIGNATURE_INTS, "rope_theta"} - set(data))
    if unknown or missing:
        raise fail(where, f"field {field!r} has unknown keys {unknown} / lacks {missing}")
    for name in _SIGNATURE_INTS:
        if not is_int(data[name]) or data[name] < 1:
            raise fail(where, f"field '{field}.{name}' must be a positive integer, not {data[name]!r}")
    if data["head_dim"] % 2:
        raise fail(where, f"field '{field}.head_dim' must be even (rotary halves), not {data['head_dim']!r}")
    theta = data["rope_theta"]
    if not is_number(theta) or theta <= 0:
        raise fail(where, f"field '{field}.rope_theta' must be a positive number, not {theta!r}")
    _check_rope_scaling(data.get("rope_scaling"), f"{field}.rope_scaling", where)
    for name in ("model_id", "tokenizer"):
        if not isinstance(data.get(name, ""), str):
            raise fail(where, f"field '{field}.{name}' must be a string")
    return ModelSignature.from_dict(data)


def _check_rope_scaling(value: Any, field: str, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise fail(where, f"field {field!r} must be an object or null, not {type(value).__name__}")
    for key, item in value.items():
        items = item if isinstance(item, list) else [item]
        if not all(x is None or isinstance(x, (str, bool)) or is_number(x) for x in items):
            raise fail(where, f"field '{field}.{key}' must be a scalar or a list of scalars")


def signature_pair(manifest: Mapping[str, Any], where: str) -> SignaturePair:
    """The ``signatures`` field: a source and a target signature."""
    data = manifest.get("signatures")
    if not isinstance(data, dict):
        raise fail(where, f"field 'signatures' must be an object, not {type(data).__name__}")
    return SignaturePair(signature(data.get("source"), "signatures.source", where),
                         signature(data.get("target"), "signatures.target", where))


def selected_layers(manifest: Mapping[str, Any], pair: SignaturePair, where: str) -> Selected:
    """``selected_layers``: one non-empty list of source layer indices per target layer, each in range."""
    data = manifest.get("selected_layers")
    if not isinstance(data, list) or len(data) != pair.target.num_layers:
        raise fail(where, f"field 'selected_layers' must be a list of {pair.target.num_layers} lists "
                          f"(one per target layer), not {_describe(data)}")
    for t, chosen in enumerate(data):
        if not isinstance(chosen, list) or not chosen:
            raise fail(where, f"field 'selected_layers[{t}]' must be a non-empty list, not {_describe(chosen)}")
        for i in chosen:
            if not is_int(i) or not 0 <= i < pair.source.num_layers:
                raise fail(where, f"field 'selected_layers[{t}]' names source layer {i!r}: the source has "
                                  f"layers 0..{pair.source.num_layers - 1}")
    return tuple(tuple(chosen) for chosen in data)


def strip_rope(manifest: Mapping[str, Any], where: str) -> bool:
    """``strip_rope``: a JSON boolean."""
    value = manifest.get("strip_rope")
    if not isinstance(value, bool):
        raise fail(where, f"field 'strip_rope' must be true or false, not {value!r}")
    return value


def attention_scaling(manifest: Mapping[str, Any], where: str) -> tuple[float, float]:
    """``attention_scaling``: positive finite numbers for source and target."""
    data = manifest.get("attention_scaling")
    if not isinstance(data, dict):
        raise fail(where, f"field 'attention_scaling' must be an object, not {type(data).__name__}")
    for side in ("source", "target"):
        if not is_number(data.get(side)) or data[side] <= 0:
            raise fail(where, f"field 'attention_scaling.{side}' must be a positive number, not {data.get(side)!r}")
    return float(data["source"]), float(data["target"])


def check_evaluation(manifest: Mapping[str, Any], where: str) -> None:
    """``evaluation`` (optional): an object whose ``attention_cosine``, the gate figure, is a number or null."""
    data = manifest.get("evaluation", {})
    if not isinstance(data, dict):
        raise fail(where, f"field 'evaluation' must be an object, not {type(data).__name__}")
    cosine = data.get("attention_cosine")
    if cosine is not None and not is_number(cosine):
        raise fail(where, f"field 'evaluation.attention_cosine' must be a number or null, not {cosine!r}")


def geometry_fields(manifest: Mapping[str, Any], where: str) -> tuple[SignaturePair, Selected, bool, tuple[float, float]]:
    """Every geometry field, checked: signatures, selected layers, strip_rope, attention scaling."""
    pair = signature_pair(manifest, where)
    selected = selected_layers(manifest, pair, where)
    check_evaluation(manifest, where)
    return pair, selected, strip_rope(manifest, where), attention_scaling(manifest, where)


def rope_shapes(pair: SignaturePair) -> dict[str, Shape]:
    """The two rope tables: ``inv_freq`` of ``head_dim // 2`` each."""
    return {"rope.source.inv_freq": (pair.source.head_dim // 2,), "rope.target.inv_freq": (pair.target.head_dim // 2,)}


def check_tensors(header: Header, expected: Mapping[str, Shape], where: str, dtype: str = FLOAT32) -> None:
    """The file holds exactly the expected tensors, each with its shape and ``dtype``."""
    missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
    if missing or extra:
        raise fail(where, f"weights file lacks tensors {_few(missing)} / has unexpected tensors {_few(extra)}")
    for name, shape in expected.items():
        found_shape, found_dtype = header[name]
        if tuple(found_shape) != shape:
            raise fail(where, f"tensor {name!r} has shape {list(found_shape)}, expected {list(shape)}")
        if found_dtype != dtype:
            raise fail(where, f"tensor {name!r} has dtype {found_dtype}, expected {dtype}")


def _few(names: list[str]) -> str:
    return str(names[:5])[:-1] + (f", ... {len(names) - 5} more]" if len(names) > 5 else "]")


def _describe(value: Any) -> str:
    return f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:40]
