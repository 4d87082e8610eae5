"""agentkv's embedded default: an in-process engine with a real prefix cache, served over vLLM's API.

Importing this package is cheap; torch and transformers load when an engine or model is first used.

Usage::

    from agentkv.local import LocalServer

    with LocalServer.from_size("small", window=2048) as server:   # hosted_vllm/agentkv-small at server.api_base
        ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentkv.local.codec import ChatRequest, HFCodec, TiktokenCodec
    from agentkv.local.engine import Delta, EngineStats, Generation, LocalEngine
    from agentkv.local.limits import ContextLengthExceeded, LengthError, check_length
    from agentkv.local.models import DEFAULT_WINDOWS, MODEL_SIZES, build_model, load_model
    from agentkv.local.prefix_cache import KVBlock, PrefixCache
    from agentkv.local.requests import ChatCompletionRequest, CompletionRequest
    from agentkv.local.sampling import SamplingParams
    from agentkv.local.server import LocalServer, LoggedRequest

_EXPORTS = {
    "ChatRequest": "agentkv.local.codec",
    "HFCodec": "agentkv.local.codec",
    "TiktokenCodec": "agentkv.local.codec",
    "Delta": "agentkv.local.engine",
    "EngineStats": "agentkv.local.engine",
    "Generation": "agentkv.local.engine",
    "LocalEngine": "agentkv.local.engine",
    "ContextLengthExceeded": "agentkv.local.limits",
    "LengthError": "agentkv.local.limits",
    "check_length": "agentkv.local.limits",
    "DEFAULT_WINDOWS": "agentkv.local.models",
    "MODEL_SIZES": "agentkv.local.models",
    "build_model": "agentkv.local.models",
    "load_model": "agentkv.local.models",
    "KVBlock": "agentkv.local.prefix_cache",
    "PrefixCache": "agentkv.local.prefix_cache",
    "ChatCompletionRequest": "agentkv.local.requests",
    "CompletionRequest": "agentkv.local.requests",
    "SamplingParams": "agentkv.local.sampling",
    "LocalServer": "agentkv.local.server",
    "LoggedRequest": "agentkv.local.server",
}

__all__ = [
    "ChatCompletionRequest",
    "ChatRequest",
    "CompletionRequest",
    "ContextLengthExceeded",
    "DEFAULT_WINDOWS",
    "Delta",
    "EngineStats",
    "Generation",
    "HFCodec",
    "KVBlock",
    "LengthError",
    "LocalEngine",
    "LocalServer",
    "LoggedRequest",
    "MODEL_SIZES",
    "PrefixCache",
    "SamplingParams",
    "TiktokenCodec",
    "build_model",
    "check_length",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentkv.local' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
