"""Token choice and incremental detokenization for the embedded engine.

:class:`Sampler` picks the next id from one position's logits (greedy at temperature 0, seeded sampling
otherwise) and never picks an id the tokenizer cannot decode. :class:`Detokenizer` turns ids into text deltas,
holding back a trailing partial UTF-8 character until it completes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection

from agentkv.embedded.engine.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch

    from agentkv.embedded.engine.codec import Codec

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
    """Chooses each next token of one sequence as :class:`SamplingParams` say, and reports its logprobs.

    Order, as vLLM applies it: the vocabulary mask and ``logit_bias``, EOS and stop ids barred before
    ``min_tokens``, the grammar's mask; then argmax at ``temperature <= 1e-5``, else top-k/top-p and seeded
    multinomial sampling. Logprobs are of the raw model output (vLLM's default ``raw_logprobs``).
    """

    def __init__(self, params: SamplingParams, bias: torch.Tensor | None = None,
                 eos_ids: Collection[int] = ()) -> None:
        import torch

        self.params = params
        self.bias = bias
        self.barred = sorted(set(eos_ids) | set(params.stop_token_ids))
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        self.generator = torch.Generator().manual_seed(seed % 2**63)
        self.steps = 0

    @property
    def finished_grammar(self) -> bool:
        """The grammar (if any) has accepted its end."""
        return self.matcher is not None and self.matcher.terminated

    def __call__(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token id and, when asked for, its logprob entry. logits: ``[vocab]``."""
        import torch

        raw = logits.float()
        scores = self._processed(raw)
        if self.params.temperature <= 1e-5:
            token = int(torch.argmax(scores))
        else:
            token = self._sample(scores)
        if self.matcher is not None:
            self.matcher.accept(token)
        self.steps += 1
        return token, self._logprob(raw, token, self.params.logprobs)

    def _processed(self, raw: torch.Tensor) -> torch.Tensor:
        import torch

        scores = raw.clone()
        if self.bias is not None:
            scores += self.bias
        if self.params.allowed_token_ids:
            allowed = torch.tensor(self.params.allowed_token_ids, dtype=torch.long)
            kept = scores[allowed].clone()
            scores.fill_(float("-inf"))
            scores[allowed] = kept
        for token_id, value in self.params.logit_bias.items():
            if 0 <= token_id < scores.shape[0]:
                scores[token_id] += float(value)
        if self.steps < self.params.min_tokens and self.barred:
            scores[[i for i in self.barred if i < scores.shape[0]]] = float("-inf")
        if self.matcher is not None:
            self.matcher.mask(scores)
        return scores

    def _sample(self, scores: torch.Tensor) -> int:
        import torch

        scores = scores / self.params.temperature
        if self.params.top_k and self.params.top_k > 0:
            kth = torch.topk(scores, min(self.params.top_k, scores.shape[0])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < self.params.top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    @staticmethod
    def _logprob(raw: torch.Tensor, token: int, top: int | None) -> TokenLogprob | None:
        return token_logprob(raw, token, top)


def token_logprob(raw: torch.Tensor, token: int, top: int | None) -> TokenLogprob | None:
    """``token``'s logprob under ``raw`` logits ``[vocab]``, its rank, and the ``top`` best (-1: all)."""
    import torch

    if top is None:
        return None
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = float(logprobs[token])
    rank = int((logprobs > chosen).sum()) + 1
    count = logprobs.shape[0] if top < 0 else min(top, logprobs.shape[0])
    best = torch.topk(logprobs, count) if count else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, chosen, rank, pairs)


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
