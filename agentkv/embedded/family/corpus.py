"""The training text every machine has: the Python standard library's own source and docstrings.

Files are listed in sorted relative-path order (tests, ``site-packages`` and ``idlelib`` left out), so
every run on the same Python sees the same text in the same order. Every ``heldout_every``-th file is
held out; the rest alternate between two disjoint halves, ``a`` and ``b``.

    split = split_corpus(stdlib_files(), heldout_every=10, max_chars=1_000_000)
    split.texts("a"), split.texts("heldout")
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CorpusSplit", "split_corpus", "stdlib_files", "stdlib_root"]

_SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib",
                            "__pycache__", "lib2to3"})


def stdlib_root() -> Path:
    """This interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``.py`` file of the standard library except tests and third-party packages, sorted."""
    base = root or stdlib_root()
    found = (p for p in base.rglob("*.py") if not _SKIPPED_PARTS.intersection(p.relative_to(base).parts))
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


@dataclass(frozen=True)
class CorpusSplit:
    """File lists per split: ``a`` and ``b`` (disjoint training halves) and ``heldout``."""

    a: tuple[Path, ...]
    b: tuple[Path, ...]
    heldout: tuple[Path, ...]

    def files(self, name: str) -> tuple[Path, ...]:
        """One split's files by name."""
        return {"a": self.a, "b": self.b, "heldout": self.heldout}[name]

    def texts(self, name: str) -> list[str]:
        """One split's file contents, in order."""
        return [read_text(path) for path in self.files(name)]


def read_text(path: Path) -> str:
    """A source file as text (undecodable bytes replaced)."""
    return path.read_text(encoding="utf-8", errors="replace")


def split_corpus(files: list[Path], *, heldout_every: int, max_chars: int | None = None) -> CorpusSplit:
    """Deal ``files`` (in order, up to ``max_chars`` characters) into halves a/b and a held-out share."""
    kept = _within_budget(files, max_chars)
    heldout = tuple(p for i, p in enumerate(kept) if i % heldout_every == heldout_every - 1)
    train = [p for i, p in enumerate(kept) if i % heldout_every != heldout_every - 1]
    return CorpusSplit(a=tuple(train[0::2]), b=tuple(train[1::2]), heldout=heldout)


def _within_budget(files: list[Path], max_chars: int | None) -> list[Path]:
    if max_chars is None:
        return list(files)
    kept, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > max_chars and kept:
            continue  # skip files that overflow; smaller later ones may still fit
        kept.append(path)
        total += size
    return kept
