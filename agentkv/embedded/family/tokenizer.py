"""A byte-level BPE tokenizer trained on the corpus with the ``tokenizers`` library.

The tokenizer carries a ChatML chat template (``<|im_start|>role\\n...<|im_end|>``), so a trained
checkpoint serves chat requests like any Qwen checkpoint; ``<|endoftext|>`` separates files in training.

    tokenizer = train_tokenizer(texts, vocab_size=4096)   # a transformers PreTrainedTokenizerFast
    ids = tokenizer.encode("def f(x):", add_special_tokens=False)
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["CHAT_TEMPLATE", "END_OF_TEXT", "SPECIAL_TOKENS", "train_tokenizer"]

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` ids (special tokens first) trained on ``texts``, deterministically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                        additional_special_tokens=[IM_START, IM_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Every text's ids, each followed by ``<|endoftext|>`` (the training stream)."""
    eos = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids: list[int] = []
    for encoded in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return ids
