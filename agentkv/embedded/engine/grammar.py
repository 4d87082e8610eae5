"""Structured outputs with xgrammar: a grammar compiled once per request, a matcher per sequence.

The spec is what vLLM's ``StructuredOutputsParams`` carries: ``json`` (a schema), ``json_object``, ``regex``,
``choice``, ``grammar`` (EBNF) or a ``structural_tag``-free tool-call form built by :mod:`agentkv.embedded.server.tools`.
JSON is compiled without free whitespace (vLLM's ``disable_any_whitespace``) so that even a random-weight model
reaches the end of the document within a few dozen tokens.

Usage::

    compiler = GrammarCompiler.for_codec(codec, vocab_size=100352)
    grammar = compiler.compile(GrammarSpec("json", {"type": "object"}))
    matcher = grammar.matcher()
    matcher.mask(logits)          # logits: [vocab], disallowed ids set to -inf in place
    matcher.accept(token_id)
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

    from agentkv.embedded.engine.codec import Codec


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: ``kind`` in json, json_object, regex, choice, grammar; ``value`` its argument."""

    kind: str
    value: Any = None


class GrammarError(ValueError):
    """A grammar that cannot be compiled (a bad schema, regex or EBNF)."""


def _vocab(codec: Codec, vocab_size: int) -> list[bytes]:
    """Each id's bytes (b"" for ids the tokenizer cannot decode)."""
    encoding = getattr(codec, "encoding", None)
    vocab = [b""] * vocab_size
    if encoding is not None:
        for i in range(min(len(encoding._mergeable_ranks), vocab_size)):
            vocab[i] = encoding.decode_single_token_bytes(i)
        for text, i in encoding._special_tokens.items():
            if i < vocab_size:
                vocab[i] = text.encode()
        return vocab
    tokenizer = codec.tokenizer  # type: ignore[attr-defined]
    for i in range(min(len(tokenizer), vocab_size)):
        vocab[i] = tokenizer.decode([i]).encode("utf-8", "replace")
    return vocab


MAX_STRING = 48
MAX_ITEMS = 8
MAX_PROPERTIES = 8
BOUND = 10**9
_LITERAL_KEYS = frozenset({"enum", "const", "default", "examples", "required", "pattern", "format", "title",
                           "description", "$ref"})
_FREE_OBJECT: dict[str, Any] = {
    "type": "object", "maxProperties": MAX_PROPERTIES, "propertyNames": {"maxLength": 32},
    "additionalProperties": {"type": ["string", "integer", "boolean", "null"]},
}


def bound_schema(schema: Any) -> Any:
    """``schema`` with size bounds added wherever it leaves a value unbounded (its own bounds are kept).

    Free strings get ``maxLength`` 48, arrays ``maxItems`` 8, integers and numbers ``[-1e9, 1e9]``. Every
    document valid under the result is valid under ``schema``. Without them a random-weight model never closes a
    string or an array (no token that ends one is ever its likeliest), so its JSON would never be complete.
    """
    if isinstance(schema, list):
        return [bound_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _LITERAL_KEYS else bound_schema(value) for key, value in schema.items()}
    if "enum" in out or "const" in out:
        return out
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds and "pattern" not in out and "format" not in out:
        out.setdefault("maxLength", max(MAX_STRING, int(out.get("minLength", 0))))
    if "array" in kinds:
        out.setdefault("maxItems", max(MAX_ITEMS, int(out.get("minItems", 0))))
    if kinds & {"integer", "number"}:
        out.setdefault("minimum", min(-BOUND, out.get("maximum", 0)))
        out.setdefault("maximum", max(BOUND, out["minimum"]))
    if "object" in kinds and out.get("additionalProperties") not in (None, False) \
            and not out.get("properties"):
        out.setdefault("maxProperties", MAX_PROPERTIES)
    return out


def bounded(spec: GrammarSpec) -> GrammarSpec:
    """``spec`` with :func:`bound_schema` applied (JSON kinds only; ``json_object`` becomes a bounded object)."""
    if spec.kind == "json_object":
        return GrammarSpec("json", bound_schema(_FREE_OBJECT))
    if spec.kind == "json":
        value = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
        return GrammarSpec("json", bound_schema(value))
    return spec


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (as vLLM compiles ``structured_outputs.choice``)."""
    return "(" + "|".join(re.escape(str(c)) for c in choices) + ")"


class CompiledGrammar:
    """A compiled grammar; :meth:`matcher` gives each sequence its own state.

    ``barred``: token ids never allowed under this grammar (for JSON: tokens holding a raw control character,
    which xgrammar's string rule lets through but JSON forbids; compact JSON never needs one).
    """

    def __init__(self, compiled: Any, vocab_size: int, barred: Any = None) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.barred = barred

    def matcher(self) -> GrammarMatcher:
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(self._compiled), self.vocab_size, self.barred)


class GrammarMatcher:
    """One sequence's position in a grammar."""

    def __init__(self, matcher: Any, vocab_size: int, barred: Any = None) -> None:
        import xgrammar as xgr

        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._barred = barred

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return bool(self._matcher.is_terminated())

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of every token the grammar does not allow next to -inf. logits: ``[vocab]`` float32."""
        import xgrammar as xgr

        self._matcher.fill_next_token_bitmask(self._bitmask)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask[0, :].to(logits.device))
        if self._barred is not None:
            logits[self._barred] = float("-inf")

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token_id)))


class GrammarCompiler:
    """xgrammar's compiler over one model's vocabulary (built once per engine, on first use)."""

    def __init__(self, codec: Codec, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        import torch

        vocab = _vocab(codec, vocab_size)
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(eos_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._controls = torch.tensor([i for i, raw in enumerate(vocab) if any(b < 0x20 for b in raw)],
                                      dtype=torch.long)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; raises :class:`GrammarError` with xgrammar's reason when it cannot."""
        try:
            with self._lock:
                barred = self._controls if spec.kind in ("json", "json_object") else None
                return CompiledGrammar(self._compile(spec), self.vocab_size, barred)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad input
            raise GrammarError(f"Invalid {spec.kind} for structured outputs: {exc}") from exc

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.kind == "json":
            schema = spec.value if isinstance(spec.value, str) else json.dumps(spec.value)
            return c.compile_json_schema(schema, any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_regex(choice_regex(spec.value))
        if spec.kind == "grammar":
            return c.compile_grammar(spec.value)
        raise GrammarError(f"Unknown structured output kind {spec.kind!r}")
