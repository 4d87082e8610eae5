"""A save_pretrained checkpoint loads with its own tokenizer and chat template, and serves."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
httpx = pytest.importorskip("httpx")

from agentkv.embedded.engine.codec import HFCodec, TiktokenCodec  # noqa: E402
from agentkv.embedded.engine import LocalEngine  # noqa: E402
from agentkv.embedded.engine.models import build_model, load_model  # noqa: E402
from agentkv.embedded.server import LocalServer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "system", "user", "assistant",
         *"hello world you are a helpful bot how do i cook rice".split()]
MESSAGES = [{"role": "system", "content": "you are a helpful bot"}, {"role": "user", "content": "how do i cook rice"}]


def save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="[UNK]",
                                        additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    build_model("tiny", seed=3, vocab_size=64).save_pretrained(str(path))
    save_tokenizer(path)
    return path


def test_checkpoint_loads_with_its_tokenizer(checkpoint):
    """load_model returns the saved weights in eval mode and the folder's tokenizer."""
    model, tokenizer = load_model(checkpoint)
    reference = build_model("tiny", seed=3, vocab_size=64)
    weight = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[weight], reference.state_dict()[weight]) and not model.training
    assert tokenizer is not None and tokenizer.chat_template == TEMPLATE


def test_engine_uses_the_checkpoints_chat_template(checkpoint):
    """The engine renders with the checkpoint's template and tokenizes with its tokenizer."""
    engine = LocalEngine.from_pretrained(checkpoint)
    assert isinstance(engine.codec, HFCodec) and engine.model_id == checkpoint.name
    assert engine.render(MESSAGES) == ("<|im_start|> system you are a helpful bot <|im_end|> "
                                       "<|im_start|> user how do i cook rice <|im_end|> <|im_start|> assistant ")
    assert engine.tokenize_chat(MESSAGES)[:8] == [1, 4, 9, 10, 11, 12, 13, 2]


def test_checkpoint_serves_chat_and_tokenize(checkpoint):
    """A served checkpoint answers chat completions whose prompt_tokens match its /tokenize count."""
    with LocalServer.from_pretrained(checkpoint, window=256, model_id="ckpt") as server, \
            httpx.Client(base_url=server.base_url) as http:
        body = {"model": "ckpt", "messages": MESSAGES, "max_tokens": 3}
        reply = http.post("/v1/chat/completions", json=body).json()
        counted = http.post("/tokenize", json={"model": "ckpt", "messages": MESSAGES}).json()
    assert reply["usage"]["prompt_tokens"] == counted["count"] == 18
    assert reply["usage"]["completion_tokens"] <= 3
    assert all(token < len(WORDS) for token in counted["tokens"])


def test_sampling_stays_inside_the_checkpoint_vocabulary(checkpoint):
    """Generated ids are always ids the checkpoint's tokenizer can decode."""
    engine = LocalEngine.from_pretrained(checkpoint)
    result = engine.generate(engine.tokenize_chat(MESSAGES), 12, temperature=1.0, seed=1)
    assert all(token < len(WORDS) for token in result.token_ids)


def test_checkpoint_without_tokenizer_falls_back_to_tiktoken(tmp_path):
    """A folder with weights only is served with cl100k_base and agentkv's template."""
    build_model("tiny", seed=0).save_pretrained(str(tmp_path))
    engine = LocalEngine.from_pretrained(tmp_path)
    assert isinstance(engine.codec, TiktokenCodec) and engine.tokenizer is None
    assert engine.render(MESSAGES).startswith("<|im_start|>system\nyou are a helpful bot<|im_end|>\n")
