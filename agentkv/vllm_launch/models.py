"""The tier's two checkpoints, built here: Qwen3 architecture, a real HF tokenizer, a Qwen3-style chat template.

No weights can be downloaded, so both models are randomly initialised from a fixed seed and saved with
``save_pretrained``. The tokenizer is a byte-level BPE trained on the standard library (it counts English at
about twice cl100k's rate, far from the estimate's prior); it carries ``<tool_call>``/``</tool_call>`` so
vLLM's hermes tool parser loads, and the chat template renders tools, tool calls and tool results like
Qwen3's and takes ``message.content`` only when it is a string (vLLM then joins content parts with ``"\\n"``).

Head size is 32: the CPU attention kernels refuse 16. Both sizes share ``num_key_value_heads`` and
``head_dim`` (a cross-model KV mapper pairs their layers). What was built is cached under a digest of the
build spec, so a changed spec builds anew and an unchanged one costs nothing.

    models = ensure_models()
    models.fast, models.slow        # save_pretrained folders
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agentkv._support.build import built_once

__all__ = ["CHAT_TEMPLATE", "SIZES", "TierModels", "ensure_models"]

CHAT_TEMPLATE = resources.files("agentkv.vllm_launch").joinpath("chat_template.jinja").read_text()
"""The chat template both checkpoints carry."""

VOCAB_SIZE = 4096
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_CORPUS_CHARS = 3_000_000
_COMMON: dict[str, Any] = {"num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 32768,
                           "rope_theta": 1_000_000.0, "tie_word_embeddings": True, "torch_dtype": "float32"}
SIZES: dict[str, dict[str, Any]] = {
    "fast": {**_COMMON, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
             "num_attention_heads": 4},
    "slow": {**_COMMON, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 8},
}
"""``Qwen3Config`` keyword arguments of the two checkpoints."""


@dataclass(frozen=True)
class TierModels:
    """Where the built checkpoints are."""

    root: Path

    @property
    def fast(self) -> Path:
        return self.root / "fast"

    @property
    def slow(self) -> Path:
        return self.root / "slow"


def default_root() -> Path:
    """``$AGENTKV_VLLM_MODELS``, else ``~/.cache/agentkv/vllm-models``."""
    configured = os.environ.get("AGENTKV_VLLM_MODELS")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "agentkv" / "vllm-models"


def spec_digest() -> str:
    """A digest of everything that decides the checkpoints' bytes."""
    spec = {"sizes": SIZES, "vocab": VOCAB_SIZE, "added": ADDED_TOKENS, "template": CHAT_TEMPLATE,
            "corpus_chars": _CORPUS_CHARS, "seed": 0, "format": 1}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def ensure_models(root: Path | None = None) -> TierModels:
    """The fast and slow checkpoints, built into ``root`` first when absent (about 30 s on 2 cores)."""
    base = (root or default_root()) / spec_digest()
    with built_once(base, base / "done") as needed:
        if needed:
            _build(base)
    return TierModels(base)


def _build(base: Path) -> None:
    staging = base.with_name(base.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = build_tokenizer()
    for name in SIZES:
        _save_model(name, tokenizer, staging / name)
    (staging / "done").write_text(spec_digest() + "\n")
    shutil.rmtree(base, ignore_errors=True)
    staging.rename(base)


def build_tokenizer() -> Any:
    """The tier's BPE tokenizer (deterministic), with the chat template and the tool-call tokens."""
    from agentkv.embedded.family.corpus import read_text, stdlib_files
    from agentkv.embedded.family.tokenizer import train_tokenizer

    texts, total = [], 0
    for path in stdlib_files():
        if total >= _CORPUS_CHARS:
            break
        text = read_text(path)
        texts.append(text)
        total += len(text)
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB_SIZE)
    tokenizer.add_tokens(list(ADDED_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _save_model(name: str, tokenizer: Any, folder: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    vocab = -(-len(tokenizer) // 128) * 128
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(vocab_size=vocab, bos_token_id=None, eos_token_id=im_end, pad_token_id=eos, **SIZES[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if name == "fast" else 1)
        model = Qwen3ForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    GenerationConfig(eos_token_id=[im_end, eos], pad_token_id=eos).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
