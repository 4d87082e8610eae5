"""agentkv's embedded default: an in-process engine with a real prefix cache, served over vLLM's API.

Importing this package is cheap; torch and transformers load when an engine or model is first used.

Usage::

    from agentkv.local import LocalServer

    with LocalServer.from_size("small", window=2048) as server:   # hosted_vllm/agentkv-small at server.api_base
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv._lazy import lazy_exports

if TYPE_CHECKING:
    from agentkv.local.engine.codec import ChatRequest, HFCodec, TiktokenCodec
    from agentkv.local.engine import Delta, EngineStats, Generation, LocalEngine
    from agentkv.local.engine.limits import ContextLengthExceeded, LengthError, check_length
    from agentkv.local.engine.models import DEFAULT_WINDOWS, MODEL_SIZES, build_model, load_model
    from agentkv.local.engine.prefix_cache import KVBlock, PrefixCache
    from agentkv.local.server.requests import ChatCompletionRequest, CompletionRequest
    from agentkv.local.engine.sampling import SamplingParams
    from agentkv.local.server import LocalServer, LoggedRequest

_EXPORTS = {
    "ChatRequest": "agentkv.local.engine.codec",
    "HFCodec": "agentkv.local.engine.codec",
    "TiktokenCodec": "agentkv.local.engine.codec",
    "Delta": "agentkv.local.engine.local_engine",
    "EngineStats": "agentkv.local.engine.local_engine",
    "Generation": "agentkv.local.engine.local_engine",
    "LocalEngine": "agentkv.local.engine.local_engine",
    "ContextLengthExceeded": "agentkv.local.engine.limits",
    "LengthError": "agentkv.local.engine.limits",
    "check_length": "agentkv.local.engine.limits",
    "DEFAULT_WINDOWS": "agentkv.local.engine.models",
    "MODEL_SIZES": "agentkv.local.engine.models",
    "build_model": "agentkv.local.engine.models",
    "load_model": "agentkv.local.engine.models",
    "KVBlock": "agentkv.local.engine.prefix_cache",
    "PrefixCache": "agentkv.local.engine.prefix_cache",
    "ChatCompletionRequest": "agentkv.local.server.requests",
    "CompletionRequest": "agentkv.local.server.requests",
    "SamplingParams": "agentkv.local.engine.sampling",
    "LocalServer": "agentkv.local.server.local_server",
    "LoggedRequest": "agentkv.local.server.local_server",
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
