"""Mapper backends by name: built-ins, ``register_mapper`` calls, and the ``agentkv.mappers`` entry points.

A factory is anything callable that returns a :class:`~agentkv.handoff.protocol.KVMapper`; to be
loadable from a directory it also has ``load(path)`` (a mapper class is both). Built-ins are named as
``"module:attribute"`` strings and imported on first use, so this module never imports torch.

    register_mapper("mine", MyMapper)
    create_mapper("identity")            # a mapper that needs no file
    load_mapper("mappers/14b-to-32b")     # reads manifest.json's "backend", then that factory's load()
"""

from __future__ import annotations

import importlib
import json
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Union

from agentkv.handoff.errors import MapperFileError, UnknownMapperError
from agentkv.handoff.protocol import KVMapper

ENTRY_POINT_GROUP = "agentkv.mappers"
MANIFEST = "manifest.json"

Factory = Callable[..., KVMapper]
_Entry = Union[Factory, str]

_BUILTINS: dict[str, str] = {
    "replay": "agentkv.handoff.builtins:ReplayMapper",
    "identity": "agentkv.handoff.builtins:IdentityMapper",
    "ridge": "agentkv.handoff.ridge:RidgeMapper",
    "mlp": "agentkv.handoff.mlp:MLPMapper",
}
_registry: dict[str, _Entry] = dict(_BUILTINS)
_entry_points_loaded = False


def register_mapper(name: str, factory: Factory | str, *, replace: bool = False) -> None:
    """Register ``factory`` (or a ``"module:attr"`` string) under ``name``."""
    if name in _registry and not replace and _registry[name] is not factory:
        raise ValueError(f"a mapper backend named {name!r} is already registered (pass replace=True)")
    _registry[name] = factory


def unregister_mapper(name: str) -> None:
    """Remove a registration (built-ins come back with :func:`reset_registry`)."""
    _registry.pop(name, None)


def reset_registry() -> None:
    """Back to the built-ins; entry points are read again on next lookup."""
    global _entry_points_loaded
    _registry.clear()
    _registry.update(_BUILTINS)
    _entry_points_loaded = False


def available_mappers() -> list[str]:
    """Every registered backend name, entry points included."""
    _load_entry_points()
    return sorted(_registry)


def get_factory(name: str) -> Factory:
    """The factory registered under ``name``, importing it if it was registered lazily."""
    entry = _registry.get(name)
    if entry is None:
        _load_entry_points()
        entry = _registry.get(name)
    if entry is None:
        raise UnknownMapperError(f"no KV mapper backend named {name!r}; known: {', '.join(available_mappers())}")
    if isinstance(entry, str):
        entry = _import(entry)
        _registry[name] = entry
    return entry


def create_mapper(name: str, **kwargs: Any) -> KVMapper:
    """Build a mapper that needs no file (``replay``, ``identity``, or a third party's)."""
    return get_factory(name)(**kwargs)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed ``manifest.json`` of a mapper directory: a JSON object, else :class:`MapperFileError`."""
    from agentkv.handoff.manifest import manifest_object

    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        raise MapperFileError(f"{path} is not a KV mapper directory (no {MANIFEST})")
    try:
        data = json.loads(manifest.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise MapperFileError(f"{manifest} is not readable JSON: {type(error).__name__}") from error
    return manifest_object(data, str(path))


def load_mapper(path: str | Path, *, source: Any = None, target: Any = None) -> KVMapper:
    """Load a saved mapper with the backend its manifest names.

    ``source``/``target`` (models or :class:`ModelSignature` s), when given, must be the models the
    mapper was calibrated for, else :class:`SignatureMismatchError`.
    """
    from agentkv.handoff.models import verify_pair

    backend = read_manifest(path).get("backend")
    if not isinstance(backend, str):
        raise MapperFileError(f"{path}/{MANIFEST}: field 'backend' must name a backend, not {backend!r}")
    try:
        factory = get_factory(backend)
    except UnknownMapperError as error:
        raise MapperFileError(f"{path}/{MANIFEST}: field 'backend' names an unregistered backend: {error}") from error
    loader = getattr(factory, "load", None)
    if loader is None:
        raise MapperFileError(f"backend {backend!r} cannot load mappers from files")
    mapper = loader(path)
    verify_pair(mapper.signature_pair, source, target)
    return mapper


def _import(target: str) -> Factory:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(point.name, point.value)
