"""A trained model family on a CPU: Qwen3-architecture models trained on the Python standard library.

Models trained on the same data with the same tokenizer are what a cross-model KV mapper is meant
for; this package trains such a family here (no downloads, no GPU), plus an unrelated model (another
seed, the other half of the corpus) and a different-tokenizer one (which the handoff signature refuses).

    from agentkv.embedded.family import ensure_family
    paths = ensure_family("micro", progress=True)   # or "full"; cached under ~/.cache/agentkv/family/
    paths.small, paths.large, paths.unrelated, paths.othertok, paths.corpus

Command line: ``agentkv train-family [--recipe full] [--out DIR] [--minutes N]``.
Importing this package does not import torch.
"""

from __future__ import annotations

from agentkv.embedded.family.build import FAMILY, FamilyPaths, ensure_family, family_root, resolve_recipe
from agentkv.embedded.family.recipe import RECIPES, Member, Recipe, Shape, members

__all__ = ["FAMILY", "RECIPES", "FamilyPaths", "Member", "Recipe", "Shape", "ensure_family", "family_root",
           "members", "resolve_recipe"]
