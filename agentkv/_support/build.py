"""Content-addressed artefacts built once per machine: a venv, checkpoints, a calibrated mapper.

    with built_once(folder, folder / "done") as needed:
        if needed:
            build(folder)          # stage elsewhere, rename into place, write the marker last
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator

__all__ = ["built_once"]


@contextlib.contextmanager
def built_once(path: Path, marker: Path) -> Iterator[bool]:
    """Yield whether ``path`` still needs building (its ``marker`` absent), holding an exclusive lock beside it while
    it does, so processes racing for the same artefact build it once and the others wait and find it built."""
    if marker.exists():
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield not marker.exists()
