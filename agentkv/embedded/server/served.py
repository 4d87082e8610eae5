"""What a request handler needs from the server it runs in (:class:`Served`), and the server-wide switches.

``routes``, ``chat`` and ``completions`` name the server through this protocol, so a handler never imports the
router that calls it (the old ``chat`` -> ``routes`` -> ``completions`` -> ``chat`` cycle).

Usage::

    def handler(served: Served, request: ...) -> ...:
        served.engine.encode_chat(...), served.max_model_len, served.options.enable_prompt_tokens_details
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    from agentkv.embedded.engine import LocalEngine
    from agentkv.embedded.engine.grammar import GrammarSpec

__all__ = ["ServeOptions", "Served"]


@dataclass(frozen=True)
class ServeOptions:
    """Server-wide switches, as vLLM's CLI flags of the same names."""

    enable_prompt_tokens_details: bool = False
    max_logprobs: int = 20
    bound_json: bool = True
    """Add size bounds to JSON grammars where the schema leaves strings, arrays or numbers unbounded."""


class Served(Protocol):
    """What the routes need from the server: the engine, how it is presented, and its options."""

    engine: LocalEngine
    created: int
    root: str
    options: ServeOptions

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def logs_requests(self) -> bool: ...

    def record(self, method: str, path: str, body: Any, headers: Mapping[str, str] | None = None) -> None: ...

    def compile_grammar(self, spec: GrammarSpec) -> Any: ...

    def observe_params(self, n: int, max_tokens: int) -> None: ...

    def metrics_text(self) -> str: ...
