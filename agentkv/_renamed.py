"""The module names of agentkv before its tree was named by where code runs, still importable, with a warning.

    import agentkv.vllm.connector    # DeprecationWarning: agentkv.vllm is agentkv.vllm_plugin now

An old name is the new module itself (never a second copy): ``agentkv.local.LocalServer is
agentkv.embedded.LocalServer``, and a vLLM launch configured with ``kv_connector_module_path:
agentkv.vllm.connector`` loads the connector it loaded before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType
from typing import Sequence

__all__ = ["RENAMED", "install"]

_OFFLINE = ("bench", "calibration", "cli", "collect", "corpus", "evaluation", "linalg", "ranking", "report", "calibrated",
            "config", "testing")
RENAMED = {
    "agentkv.local": "agentkv.embedded",
    "agentkv.vllm": "agentkv.vllm_plugin",
    "agentkv.vllm.params": "agentkv.wire.kv_transfer",
    "agentkv.vllm_cpu": "agentkv.vllm_launch",
    "agentkv.ledger": "agentkv.cache_ledger",
    "agentkv.warm.guards": "agentkv.state.guards",
    **{f"agentkv.handoff.{name}": f"agentkv.handoff.offline.{name}" for name in _OFFLINE},
}
"""Old name -> new name; a name below an old one moves with it (``agentkv.local.server`` -> ``agentkv.embedded.server``)."""


def new_name(old: str) -> str | None:
    """Where ``old`` lives now, or None when it was not renamed (the longest renamed prefix wins)."""
    parts = old.split(".")
    for cut in range(len(parts), 1, -1):
        moved = RENAMED.get(".".join(parts[:cut]))
        if moved is not None:
            return ".".join([moved, *parts[cut:]])
    return None


class _Renamed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name first (before the path finder would load a second copy) and hands over the new module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        moved = new_name(fullname) if fullname.startswith("agentkv.") else None
        if moved is None:
            return None
        found = importlib.util.find_spec(moved)  # its file is the old name's too (``python -m`` sets ``__file__``)
        return importlib.util.spec_from_loader(fullname, self, origin=found.origin if found is not None else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        moved = new_name(spec.name)
        assert moved is not None
        warnings.warn(f"{spec.name} is {moved} now; import it by its new name", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(moved)
        spec.loader_state = module.__spec__  # the import system sets the old spec on it next: put it back then
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported (its own ``__spec__`` restored)."""
        spec = module.__spec__
        if spec is not None and isinstance(spec.loader_state, importlib.machinery.ModuleSpec):
            module.__spec__ = spec.loader_state

    def is_package(self, fullname: str) -> bool:
        """Whether the new module is a package (``python -m`` runs an old package's ``__main__``)."""
        moved = new_name(fullname)
        found = importlib.util.find_spec(moved) if moved is not None else None
        return found is not None and found.submodule_search_locations is not None

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m`` with an old name (runpy runs it as ``__main__``)."""
        moved = new_name(fullname)
        found = importlib.util.find_spec(moved) if moved is not None else None
        if found is None or found.loader is None or not hasattr(found.loader, "get_code"):
            return None
        warnings.warn(f"{fullname} is {moved} now; run it by its new name", DeprecationWarning, stacklevel=2)
        return found.loader.get_code(moved)  # type: ignore[no-any-return]


def install() -> None:
    """Put the old names' finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Renamed) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Renamed())
