"""The driver: corpus -> tokenizers -> members, each step skipped when its output is already on disk.

    paths = ensure_family("micro", progress=True)     # trains into the cache unless it is there
    LocalServer.from_pretrained(paths.small)           # a trained checkpoint, served like any other

A family folder holds ``small/``, ``large/``, ``small-unrelated/``, ``small-othertok/`` (each a
``save_pretrained`` checkpoint with its tokenizer and a ``training.json``), ``tokenizers/``,
``corpus/`` (the held-out files as text, for ``agentkv calibrate --corpus``), ``family.json`` and,
while a member trains, ``.state/<member>.pt`` (what a resumed run continues from).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from agentkv.embedded.family.corpus import CorpusSplit, read_text, split_corpus, stdlib_files
from agentkv.embedded.family.recipe import FAMILY_TOKENIZER, RECIPES, Member, Recipe, members

__all__ = ["FamilyPaths", "ensure_family", "family_root", "resolve_recipe"]

MEMBER_NAMES = tuple(m.name for m in members(RECIPES["micro"]))
FAMILY = ("small", "large")


@dataclass(frozen=True)
class FamilyPaths:
    """Where a family's checkpoints and calibration corpus are."""

    root: Path

    @property
    def small(self) -> Path:
        return self.root / "small"

    @property
    def large(self) -> Path:
        return self.root / "large"

    @property
    def unrelated(self) -> Path:
        return self.root / "small-unrelated"

    @property
    def othertok(self) -> Path:
        return self.root / "small-othertok"

    @property
    def corpus(self) -> Path:
        """Held-out standard-library files (no member trained on them), as ``.txt``."""
        return self.root / "corpus"

    def member(self, name: str) -> Path:
        return self.root / name

    def trained(self, name: str) -> bool:
        """True once ``name``'s checkpoint is complete."""
        return (self.root / name / "training.json").exists()

    def report(self) -> dict[str, Any]:
        """Every finished member's ``training.json``, by name."""
        return {name: json.loads((self.root / name / "training.json").read_text())
                for name in MEMBER_NAMES if self.trained(name)}


def resolve_recipe(recipe: str | Recipe, minutes: float | None = None, seed: int | None = None) -> Recipe:
    """A named or given recipe, optionally rescaled to ``minutes`` and reseeded."""
    chosen = RECIPES[recipe] if isinstance(recipe, str) else recipe
    chosen = chosen.scaled(minutes) if minutes is not None else chosen
    return chosen if seed is None else _with_seed(chosen, seed)


def _with_seed(recipe: Recipe, seed: int) -> Recipe:
    from dataclasses import replace

    return replace(recipe, seed=seed)


def family_root(recipe: Recipe) -> Path:
    """``$AGENTKV_CACHE_DIR/family/<recipe key>`` (default ``~/.cache/agentkv/family/...``)."""
    from agentkv._support.env import cache_dir

    return cache_dir() / "family" / recipe.key()


def ensure_family(recipe: str | Recipe = "micro", *, out: str | Path | None = None, progress: bool = True,
                  only: Sequence[str] | None = None, threads: int | None = None) -> FamilyPaths:
    """Train whatever of the family is missing (all four members, or ``only`` these) and return its paths.

    ``out`` defaults to :func:`family_root`. Finished members are kept; an interrupted one resumes
    from its last saved state. ``threads`` overrides the recipe's torch thread count.
    """
    from agentkv.embedded.engine.models import intra_op_threads

    chosen = resolve_recipe(recipe)
    paths = FamilyPaths(Path(out) if out is not None else family_root(chosen))
    wanted = [m for m in members(chosen) if only is None or m.name in only]
    if all(paths.trained(m.name) for m in wanted):
        return paths
    paths.root.mkdir(parents=True, exist_ok=True)
    split = split_corpus(stdlib_files(), heldout_every=chosen.heldout_every, max_chars=chosen.corpus_chars)
    _write_corpus(paths.corpus, split)
    with intra_op_threads(threads or chosen.threads):
        for member in wanted:
            if not paths.trained(member.name):
                _train_member(paths, chosen, member, split, progress)
    _write_summary(paths, chosen)
    return paths


def _write_corpus(folder: Path, split: CorpusSplit) -> None:
    if folder.exists():
        return
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for index, path in enumerate(split.heldout):
        (staging / f"{index:04d}-{path.stem}.txt").write_text(read_text(path), encoding="utf-8")
    staging.rename(folder)


def _tokenizer(paths: FamilyPaths, recipe: Recipe, which: str, split: CorpusSplit) -> Any:
    from transformers import PreTrainedTokenizerFast

    from agentkv.embedded.family.tokenizer import train_tokenizer

    folder = paths.root / "tokenizers" / which
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    size = recipe.vocab_size if which == FAMILY_TOKENIZER else recipe.other_vocab_size
    tokenizer = train_tokenizer(split.texts("a") + split.texts("b"), size)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def _train_member(paths: FamilyPaths, recipe: Recipe, member: Member, split: CorpusSplit, progress: bool) -> None:
    import torch

    from agentkv.embedded.family.tokenizer import encode_documents
    from agentkv.embedded.family.train import TrainPlan, heldout_loss, new_model, train

    tokenizer = _tokenizer(paths, recipe, member.tokenizer, split)
    stream = torch.tensor(encode_documents(tokenizer, split.texts(member.half)), dtype=torch.long)
    heldout = torch.tensor(encode_documents(tokenizer, split.texts("heldout")), dtype=torch.long)
    config = member_config(recipe, member, tokenizer)
    model = new_model(config, seed=member.seed)
    plan = TrainPlan(steps=member.steps, batch_size=recipe.batch_size, seq_len=recipe.seq_len, lr=recipe.lr,
                     seed=member.seed)
    state = paths.root / ".state" / f"{member.name}.pt"
    result = train(model, stream, plan, state_path=state, progress=_bar(member.name) if progress else None)
    loss = heldout_loss(model, heldout, recipe.seq_len, recipe.heldout_tokens)
    report = {"member": asdict(member), "recipe": recipe.key(), **asdict(result),
              "parameters": sum(p.numel() for p in model.parameters()), "heldout_loss": round(loss, 4),
              "heldout_tokens": min(len(heldout), recipe.heldout_tokens), "train_stream_tokens": len(stream),
              "vocab_size": len(tokenizer), "tokenizer_fingerprint": config.tokenizer_fingerprint}
    _save_member(paths.member(member.name), model, tokenizer, report)
    state.unlink(missing_ok=True)


def member_config(recipe: Recipe, member: Member, tokenizer: Any) -> Any:
    """The ``Qwen3Config`` of one member (tied embeddings, the tokenizer's vocabulary and stop tokens)."""
    from transformers import Qwen3Config

    from agentkv.embedded.family.tokenizer import END_OF_TEXT, IM_END
    from agentkv.embedded.engine.models import vocab_fingerprint

    shape = member.shape
    stops = [tokenizer.convert_tokens_to_ids(END_OF_TEXT), tokenizer.convert_tokens_to_ids(IM_END)]
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=recipe.kv_heads, head_dim=recipe.head_dim,
                         max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=stops, pad_token_id=stops[0])
    config.tokenizer_fingerprint = vocab_fingerprint(tokenizer.get_vocab())
    config._attn_implementation = "sdpa"
    return config


def _save_member(folder: Path, model: Any, tokenizer: Any, report: dict[str, Any]) -> None:
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    (staging / "training.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def _write_summary(paths: FamilyPaths, recipe: Recipe) -> None:
    summary = {"recipe": {**asdict(recipe), "key": recipe.key()}, "members": paths.report(),
               "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (paths.root / "family.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def _bar(name: str) -> Any:
    from tqdm import tqdm

    return lambda total, done, _label: tqdm(total=total, initial=done, desc=f"train {name}", unit="step",
                                            leave=True, mininterval=1.0)
