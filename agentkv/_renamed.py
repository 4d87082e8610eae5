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
from types import ModuleType
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
        if not fullname.startswith("agentkv.") or new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        moved = new_name(spec.name)
        assert moved is not None
        warnings.warn(f"{spec.name} is {moved} now; import it by its new name", DeprecationWarning, stacklevel=2)
        return importlib.import_module(moved)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


def install() -> None:
    """Put the old names' finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Renamed) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Renamed())
