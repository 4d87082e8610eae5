"""The one place agentkv reads its environment, always at call time.

Variables:

- ``AGENTKV_WARM_AHEAD``: ``0``/``false``/``off`` disables warm-ahead without a restart.
- ``AGENTKV_CACHE_SALT_SECRET``: the secret that per-tenant ``cache_salt`` values are derived from
  when a Session is not given one explicitly.
- ``AGENTKV_REDIS_URL``: a ``redis://`` URL; Sessions not given a ``state=`` then share their
  warm-ahead guards and discovered windows through that Redis (see ``docs/replicas.md``).
- ``AGENTKV_LOG_PROMPTS``: ``1`` lets debug events carry prompt text (off by default; events carry
  sizes and hashes only).
- ``AGENTKV_CACHE_DIR``: where agentkv keeps what it builds (trained model families); default
  ``~/.cache/agentkv``.
- ``TIKTOKEN_CACHE_DIR``: when unset, pointed at the encodings litellm ships, so tiktoken never
  downloads.
- ``LITELLM_LOCAL_MODEL_COST_MAP``: defaulted to ``True`` before litellm is first imported, so that
  importing it never fetches a cost map over the network.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

_FALSE = {"0", "false", "no", "off"}


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in _FALSE


def warm_ahead_enabled() -> bool:
    """True unless ``AGENTKV_WARM_AHEAD`` says off; read on every call."""
    return _flag("AGENTKV_WARM_AHEAD", True)


def log_prompts() -> bool:
    """True when ``AGENTKV_LOG_PROMPTS`` allows prompt text in debug events."""
    return _flag("AGENTKV_LOG_PROMPTS", False)


def cache_salt_secret() -> str | None:
    """The configured salt secret, or None."""
    return os.environ.get("AGENTKV_CACHE_SALT_SECRET") or None


def redis_url() -> str | None:
    """The shared state store's URL (``AGENTKV_REDIS_URL``), or None: read on every call."""
    return (os.environ.get("AGENTKV_REDIS_URL") or "").strip() or None


def cache_dir() -> Path:
    """``AGENTKV_CACHE_DIR``, or ``~/.cache/agentkv``."""
    configured = os.environ.get("AGENTKV_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "agentkv"


def litellm_tokenizer_dir() -> Path | None:
    """The folder of tiktoken encodings that litellm ships, found without importing litellm."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "litellm_core_utils" / "tokenizers"
    return path if path.is_dir() else None


def ensure_tiktoken_offline() -> None:
    """Point ``TIKTOKEN_CACHE_DIR`` at litellm's shipped encodings unless the user set it."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return
    path = litellm_tokenizer_dir()
    if path is not None:
        os.environ["TIKTOKEN_CACHE_DIR"] = str(path)


def import_litellm() -> Any:
    """Import litellm lazily, with its cost map local and tiktoken offline."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    ensure_tiktoken_offline()
    import litellm

    return litellm


class LazyLitellm:
    """litellm as a completion client, imported on first use: on the calling thread for
    ``completion``, on a worker thread for ``acompletion`` (the import takes seconds; an event loop
    must not wait on it)."""

    def __init__(self) -> None:
        self._module: Any = None

    def _litellm(self) -> Any:
        if self._module is None:
            self._module = import_litellm()
        return self._module

    def completion(self, **kwargs: Any) -> Any:
        return self._litellm().completion(**kwargs)

    async def acompletion(self, **kwargs: Any) -> Any:
        if self._module is None:
            import asyncio

            self._module = await asyncio.to_thread(import_litellm)
        return await self._module.acompletion(**kwargs)
