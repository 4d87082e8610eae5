"""The embedded engine's models: Qwen3-architecture causal LMs built from a seed, or loaded from a checkpoint.

No weights are downloaded. :func:`build_model` makes a randomly initialised model of a named size with a fixed
seed, so two processes that build ``"small"`` get identical weights. :func:`load_model` reads a
``save_pretrained`` folder and its tokenizer, when it has one, and records the tokenizer's
:func:`vocab_fingerprint` on the config (``config.tokenizer_fingerprint``), which the handoff signature compares.

Every size shares ``num_key_value_heads`` and ``head_dim``, so the KV of any two sizes has the same per-layer
shape ``[kv_heads, seq, head_dim]`` (what a cross-model KV mapper pairs). The vocabulary covers tiktoken's
``cl100k_base`` (100,277 ids, padded to a multiple of 128) and the embeddings are tied to keep memory down.

Usage::

    model = build_model("small")                      # eval mode, float32
    model, tokenizer = load_model("/path/to/ckpt")    # tokenizer is None when the folder has none
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM

VOCAB_SIZE = 100352
"""cl100k_base's 100,277 ids rounded up to a multiple of 128."""

KV_HEADS = 2
HEAD_DIM = 64

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": 100257,
    "pad_token_id": None,
}

MODEL_SIZES: dict[str, dict[str, Any]] = {
    # Tests: the cheapest model that still has every moving part (GQA, several layers).
    "tiny": {**_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4},
    # The fast model: a 1.2K-token prompt prefills in ~0.2 s on two CPU cores.
    "small": {**_COMMON, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 4},
    # The slow model: a 3K-token cold prefill takes ~2 s and 16K ~25 s on two CPU cores.
    "large": {**_COMMON, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
              "num_attention_heads": 8},
}
"""Named sizes: ``Qwen3Config`` keyword arguments. All share ``num_key_value_heads`` and ``head_dim``."""

DEFAULT_WINDOWS: dict[str, int] = {"tiny": 2048, "small": 2048, "large": 16384}
"""The ``max_model_len`` each size is served with unless told otherwise."""


def build_config(size: str, **overrides: Any) -> Any:
    """The ``Qwen3Config`` of a named size, with ``overrides`` applied on top."""
    from transformers import Qwen3Config

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    config = Qwen3Config(**{**MODEL_SIZES[size], **overrides})
    config._attn_implementation = "sdpa"
    return config


def build_model(
    size: str, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any
) -> Qwen3ForCausalLM:
    """A randomly initialised model of ``size``, identical for the same seed, in eval mode."""
    import torch
    from transformers import Qwen3ForCausalLM

    config = build_config(size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.to(dtype or torch.float32).eval()


def load_model(path: str | Path) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerBase | None]:
    """A checkpoint folder's model (eval mode, sdpa attention) and its tokenizer, or None without one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    tokenizer = _load_tokenizer(Path(path))
    if tokenizer is not None and not getattr(model.config, "tokenizer_fingerprint", None):
        model.config.tokenizer_fingerprint = vocab_fingerprint(tokenizer.get_vocab())
    return model.eval(), tokenizer


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """A short hash of a token -> id map: equal exactly when the ids mean the same strings."""
    text = json.dumps(sorted(vocab.items(), key=lambda item: item[1]), ensure_ascii=False)
    return "vocab-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).exists() for name in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """Run torch ops in this thread with ``count`` intra-op threads (None: leave as is), then restore."""
    import torch

    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def generation_eos_ids(model: Any) -> frozenset[int]:
    """The EOS ids a checkpoint's generation config names (vLLM stops on these too)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
