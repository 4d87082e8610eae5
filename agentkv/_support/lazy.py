"""Names a package exports without importing them: loaded on first access (PEP 562), then kept.

    __getattr__, __dir__ = lazy_exports(__name__, {"RedisStore": "agentkv.state.redis"}, globals(), __all__)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any],
                 public: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``exports`` maps a name to the module that defines it; the
    module is imported on the name's first access, and the name is then bound in ``namespace`` (the package's
    globals) so the next access costs nothing."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(public))

    return __getattr__, __dir__
