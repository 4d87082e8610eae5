"""Token choice and incremental detokenization for the embedded engine.

:class:`Sampler` picks the next id from one position's logits (greedy at temperature 0, seeded sampling
otherwise) and never picks an id the tokenizer cannot decode. :class:`Detokenizer` turns ids into text deltas,
holding back a trailing partial UTF-8 character until it completes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Sequence

if TYPE_CHECKING:
    import torch

    from agentkv.local.codec import Codec

_REPLACEMENT = "\ufffd"


def logit_bias(codec: Codec, model_vocab: int) -> torch.Tensor | None:
    """A ``[model_vocab]`` bias that is 0 for ids ``codec`` can decode and -inf for the rest (None: all ok)."""
    import torch

    valid = codec.valid_ids()
    if valid is None and codec.vocab_ids >= model_vocab:
        return None
    bias = torch.full((model_vocab,), float("-inf"))
    ids = torch.tensor(list(valid) if valid is not None else range(codec.vocab_ids), dtype=torch.long)
    bias[ids[ids < model_vocab]] = 0.0
    return bias


class Sampler:
    """Chooses each next token: argmax at ``temperature <= 0``, else seeded multinomial sampling."""

    def __init__(self, temperature: float = 0.0, seed: int | None = None, bias: torch.Tensor | None = None):
        import torch

        self.temperature = float(temperature or 0.0)
        self.bias = bias
        self.generator = torch.Generator().manual_seed(seed if seed is not None else 0)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id. logits: ``[vocab]``."""
        import torch

        scores = logits.float()
        if self.bias is not None:
            scores = scores + self.bias
        if self.temperature <= 0.0:
            return int(torch.argmax(scores))
        probs = torch.softmax(scores / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class Detokenizer:
    """Text deltas for a growing list of ids; ids in ``skip`` (EOS) add no text."""

    def __init__(self, codec: Codec, skip: Collection[int] = ()) -> None:
        self.codec = codec
        self.skip = frozenset(skip)
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """Add one id; the new text, or "" while a multi-byte character is incomplete."""
        if token_id not in self.skip:
            self.ids.append(token_id)
        text = self.codec.decode(self.ids)
        if text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Whatever text is still held back (a dangling partial character becomes U+FFFD)."""
        return self._advance(self.codec.decode(self.ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self.emitted) :]  # earlier text never changes once it has no trailing U+FFFD
        self.emitted = text
        return delta


def visible_text(codec: Codec, ids: Sequence[int], skip: Collection[int]) -> str:
    """The full text of ``ids`` without the ``skip`` ids."""
    return codec.decode([i for i in ids if i not in skip])
