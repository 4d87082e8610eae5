"""The in-process engine: a transformers model, a real prefix cache, scheduling, sampling and grammars.

No sockets and nothing of HTTP here: :mod:`agentkv.embedded.server` serves an engine over vLLM's API and depends on
this package, never the other way round. Importing it is cheap; torch and transformers load when an engine or
model is first used.

Modules: ``local_engine`` (:class:`LocalEngine`), ``models`` (build and load checkpoints), ``codec`` (tokenizer and
chat template) with ``chat_format`` (messages as vLLM hands them to a template), ``prefix_cache`` and ``eviction``
(KV blocks and which go), ``kv`` (KV tensors in and out), ``scheduler`` (turns on the model), ``sampling`` and
``decoding`` (parameters, stop strings, the sampler, detokenizing), ``grammar`` (structured outputs), ``limits``
(the window rules).

Usage::

    from agentkv.embedded.engine import LocalEngine

    engine = LocalEngine.from_size("small")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv._support.lazy import lazy_exports

if TYPE_CHECKING:
    from agentkv.embedded.engine.local_engine import Delta, EngineStats, Generation, LocalEngine

_EXPORTS = {name: "agentkv.embedded.engine.local_engine" for name in ("Delta", "EngineStats", "Generation",
                                                                    "LocalEngine")}

__all__ = ["Delta", "EngineStats", "Generation", "LocalEngine"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
