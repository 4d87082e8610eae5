"""What the chat and completions handlers share: prompt text to checked token ids, window errors as 400s, the
structured-output constraint, and how a token is named in logprobs.

Usage::

    tokens = tokenize_text(engine, text, served.max_model_len, add_special_tokens=False)
    refuse(output_over_window(max_tokens, served.max_model_len))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.embedded.engine.grammar import GrammarError, GrammarSpec, bounded
from agentkv.embedded.engine.limits import LengthError, prompt_over_window, text_over_window
from agentkv.embedded.server import protocol
from agentkv.embedded.server.request_errors import RequestError

if TYPE_CHECKING:
    from agentkv.embedded.engine import LocalEngine
    from agentkv.embedded.server.served import Served

__all__ = ["compile_constraint", "refuse", "token_text", "tokenize_text"]


def compile_constraint(served: Served, spec: GrammarSpec | None) -> Any:
    """The compiled grammar for ``spec`` (None for none), bounded unless the server says not; a bad one is a 400."""
    if spec is None:
        return None
    try:
        return served.compile_grammar(bounded(spec) if served.options.bound_json else spec)
    except GrammarError as exc:
        raise RequestError(str(exc), param="structured_outputs") from None


def refuse(error: LengthError | None) -> None:
    """Raise a window error as the 400 it is answered with."""
    if error is not None:
        raise RequestError(error.message, param=error.param)


def tokenize_text(engine: LocalEngine, text: str, max_model_len: int, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids, after vLLM's character pre-check and with its prompt-over-the-window check."""
    refuse(text_over_window(len(text), max_model_len, engine.codec.max_chars_per_token))
    tokens = engine.codec.encode(text, add_special_tokens=add_special_tokens)
    refuse(prompt_over_window(len(tokens), max_model_len))
    return tokens


def token_text(served: Served, as_ids: bool = False) -> protocol.TokenText:
    """A token's own text for logprob entries ("" for ids the tokenizer cannot decode), or ``token_id:N``."""
    codec = served.engine.codec

    def text(token_id: int) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        try:
            return codec.token_strs([token_id])[0]
        except (KeyError, ValueError, IndexError):
            return ""

    return text
