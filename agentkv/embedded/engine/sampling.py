"""What one sequence is asked to generate, and when it stops: pure data and pure text logic.

:class:`SamplingParams` is the engine's view of a request's sampling fields (vLLM's ``SamplingParams`` subset
that agentkv serves). :class:`StopChecker` finds stop strings in the growing text as vLLM's detokenizer does:
the text is cut before the stop string (or after it with ``include_stop_str_in_output``), and while streaming
the last ``len(longest stop) - 1`` characters are held back so a stop string is never half-sent.

Usage::

    params = SamplingParams(max_tokens=32, temperature=0.7, seed=1, stop=("\\n\\n",), logprobs=5)
    checker = StopChecker(params.stop, include=False)
    delta, hit = checker.push("Hello\\n\\nWorld")     # ("Hello", "\\n\\n")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampling fields; ``grammar`` is a compiled structured-output grammar or None.

    ``logprobs``: how many top alternatives to return per generated token (None: no logprobs; 0: only the
    chosen token's; -1: the whole vocabulary). ``prompt_logprobs`` likewise for prompt positions.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Any = None
    allowed_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and rank, and the top alternatives as ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class StopChecker:
    """Finds the first stop string in streamed text and holds back what could still become one."""

    def __init__(self, stops: tuple[str, ...], *, include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1 if not include else 0
        self.text = ""
        self.sent = 0
        self.stopped: str | None = None

    def push(self, delta: str) -> tuple[str, str | None]:
        """Add generated text; returns the text that may be sent now and the stop string hit (or None)."""
        if self.stopped is not None:
            return "", self.stopped
        start = max(0, len(self.text) - self.hold - 1 - max((len(s) for s in self.stops), default=0))
        self.text += delta
        hit = self._find(start)
        if hit is not None:
            index, stop = hit
            self.stopped = stop
            self.text = self.text[: index + len(stop)] if self.include else self.text[:index]
            return self._release(len(self.text)), stop
        return self._release(max(self.sent, len(self.text) - self.hold)), None

    def flush(self) -> str:
        """Everything still held back (at the end of the sequence)."""
        return self._release(len(self.text))

    def _find(self, start: int) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(found) if found else None

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out
