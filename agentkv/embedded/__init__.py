"""agentkv's embedded default: an in-process engine with a real prefix cache, served over vLLM's API.

Importing this package is cheap; torch and transformers load when an engine or model is first used.

Usage::

    from agentkv.embedded import LocalServer, engine_at

    with LocalServer.from_size("small", window=2048) as server:   # hosted_vllm/agentkv-small at server.api_base
        engine_at(server.api_base) is server.engine               # how a KV handoff finds engines in-process
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv._support.lazy import lazy_exports

if TYPE_CHECKING:
    from agentkv.embedded.engine.codec import ChatRequest, HFCodec, TiktokenCodec
    from agentkv.embedded.engine import Delta, EngineStats, Generation, LocalEngine
    from agentkv.embedded.engine.limits import ContextLengthExceeded, LengthError, check_length
    from agentkv.embedded.engine.models import DEFAULT_WINDOWS, MODEL_SIZES, build_model, load_model
    from agentkv.embedded.engine.prefix_cache import KVBlock, PrefixCache
    from agentkv.embedded.server.requests import ChatCompletionRequest, CompletionRequest
    from agentkv.embedded.engine.sampling import SamplingParams
    from agentkv.embedded.server import LocalServer, LoggedRequest, engine_at

_EXPORTS = {
    "ChatRequest": "agentkv.embedded.engine.codec",
    "HFCodec": "agentkv.embedded.engine.codec",
    "TiktokenCodec": "agentkv.embedded.engine.codec",
    "Delta": "agentkv.embedded.engine.local_engine",
    "EngineStats": "agentkv.embedded.engine.local_engine",
    "Generation": "agentkv.embedded.engine.local_engine",
    "LocalEngine": "agentkv.embedded.engine.local_engine",
    "ContextLengthExceeded": "agentkv.embedded.engine.limits",
    "LengthError": "agentkv.embedded.engine.limits",
    "check_length": "agentkv.embedded.engine.limits",
    "DEFAULT_WINDOWS": "agentkv.embedded.engine.models",
    "MODEL_SIZES": "agentkv.embedded.engine.models",
    "build_model": "agentkv.embedded.engine.models",
    "load_model": "agentkv.embedded.engine.models",
    "KVBlock": "agentkv.embedded.engine.prefix_cache",
    "PrefixCache": "agentkv.embedded.engine.prefix_cache",
    "ChatCompletionRequest": "agentkv.embedded.server.requests",
    "CompletionRequest": "agentkv.embedded.server.requests",
    "SamplingParams": "agentkv.embedded.engine.sampling",
    "LocalServer": "agentkv.embedded.server.local_server",
    "LoggedRequest": "agentkv.embedded.server.local_server",
    "engine_at": "agentkv.embedded.server.local_server",
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
    "engine_at",
    "load_model",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
