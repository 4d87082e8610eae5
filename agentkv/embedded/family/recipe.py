"""What a trained family is made of: plain, frozen recipes (no torch).

A family is models trained on the same data with the same tokenizer. Each recipe trains four members:

- ``small`` and ``large``: the family, on half A of the corpus with the family's tokenizer;
- ``small-unrelated``: the small shape with another seed, on the disjoint half B (same tokenizer);
- ``small-othertok``: the small shape on half A, with a tokenizer of another vocabulary size, trained
  a quarter as long (the handoff signature refuses it before any figure is measured).

    recipe = RECIPES["full"].scaled(minutes=30)   # twice the steps of every member
    recipe.key()                                  # "full-3f2a..." (the cache folder's name)
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, replace

__all__ = ["RECIPES", "Member", "Recipe", "Shape", "members"]

FAMILY_TOKENIZER = "family"
OTHER_TOKENIZER = "other"


@dataclass(frozen=True)
class Shape:
    """One model's depth and width (the KV heads and head dim come from the recipe, shared by all)."""

    layers: int
    hidden: int
    heads: int
    intermediate: int


@dataclass(frozen=True)
class Recipe:
    """How a family is trained.

    ``*_steps`` are optimizer steps of ``batch_size`` sequences of ``seq_len`` tokens; ``minutes`` is
    what small + large take on a two-core CPU, which :meth:`scaled` uses to turn a budget into steps.
    ``corpus_chars`` caps the standard-library text used (None: all of it); every ``heldout_every``-th
    file is held out of training for the held-out loss and the calibration corpus. ``threads`` is
    torch's intra-op thread count while training (1 for tiny models: their small matmuls lose more to
    thread hand-offs on a busy two-core machine than they gain).
    """

    name: str
    vocab_size: int
    other_vocab_size: int
    kv_heads: int
    head_dim: int
    small: Shape
    large: Shape
    seq_len: int
    batch_size: int
    small_steps: int
    large_steps: int
    lr: float
    minutes: float
    corpus_chars: int | None = None
    heldout_every: int = 10
    heldout_tokens: int = 65536
    seed: int = 0
    threads: int = 2

    def scaled(self, minutes: float) -> Recipe:
        """The same recipe with every member's steps scaled to a budget of ``minutes``."""
        factor = minutes / self.minutes
        return replace(self, small_steps=max(1, round(self.small_steps * factor)),
                       large_steps=max(1, round(self.large_steps * factor)), minutes=minutes)

    def key(self) -> str:
        """``name-hash``: changes with any field and with the Python version (whose stdlib is the corpus)."""
        fields = {**asdict(self), "python": "{}.{}".format(*sys.version_info[:2])}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.name}-{digest}"


@dataclass(frozen=True)
class Member:
    """One model of a family: its folder name, shape, data half, seed, tokenizer and steps."""

    name: str
    shape: Shape
    half: str
    seed: int
    tokenizer: str
    steps: int


def members(recipe: Recipe) -> tuple[Member, ...]:
    """The four models a recipe trains, in training order."""
    small, seed = recipe.small_steps, recipe.seed
    return (  # the comparison members repeat the small model's recipe, changing one thing each
        Member("small", recipe.small, "a", seed, FAMILY_TOKENIZER, small),
        Member("large", recipe.large, "a", seed, FAMILY_TOKENIZER, recipe.large_steps),
        Member("small-unrelated", recipe.small, "b", seed + 1, FAMILY_TOKENIZER, small),
        # Only there to be refused by the signature check, so a quarter of the steps.
        Member("small-othertok", recipe.small, "a", seed, OTHER_TOKENIZER, max(1, small // 4)),
    )


RECIPES: dict[str, Recipe] = {
    # Tests: seconds on two cores; about 1 MB of the stdlib, models of a few hundred thousand parameters.
    "micro": Recipe(name="micro", vocab_size=512, other_vocab_size=384, kv_heads=2, head_dim=16,
                    small=Shape(2, 64, 4, 128), large=Shape(3, 96, 6, 192), seq_len=64, batch_size=16,
                    small_steps=150, large_steps=150, lr=3e-3, minutes=0.5, corpus_chars=1_000_000,
                    heldout_tokens=8192, threads=1),
    # The demo's and the docs' family: 4 x 256 and 8 x 512 sharing 2 KV heads of 64, as the embedded sizes.
    # The demo's and the docs' family: 4 x 256 and 6 x 384, sharing 2 KV heads of 64 (as the embedded sizes).
    # ~0.9 s per small step measured on two quiet cores, ~2.5 s per large step estimated: small + large ~12 min.
    "full": Recipe(name="full", vocab_size=4096, other_vocab_size=3072, kv_heads=2, head_dim=64,
                   small=Shape(4, 256, 4, 768), large=Shape(6, 384, 6, 1024), seq_len=256, batch_size=16,
                   small_steps=240, large_steps=200, lr=2e-3, minutes=12.0),
}
"""The named recipes. ``minutes`` is the small + large budget on two cores; the two comparison members
(``small-unrelated``, ``small-othertok``) each cost one more small model."""
