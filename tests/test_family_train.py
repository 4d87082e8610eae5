"""Family training is resumable and deterministic; recipes and signatures are plain data."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentkv.handoff.signature import ModelSignature  # noqa: E402
from agentkv.embedded.family import RECIPES, members  # noqa: E402
from agentkv.embedded.family.train import TrainPlan, batch_at, new_model, train  # noqa: E402

PLAN = TrainPlan(steps=4, batch_size=2, seq_len=8, lr=1e-2, seed=5, save_every=2)
STREAM = torch.arange(200) % 31


def tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)


class StopAfter:
    """A progress bar that interrupts training after ``limit`` steps, as Ctrl-C would."""

    def __init__(self, limit: int) -> None:
        self.limit, self.done = limit, 0

    def __call__(self, total, done, label):
        self.done = done
        return self

    def update(self, n):
        self.done += n
        if self.done > self.limit:
            raise KeyboardInterrupt

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


def test_batches_are_a_function_of_seed_and_step():
    """The same (seed, step) gives the same batch; another step gives another one."""
    assert torch.equal(batch_at(STREAM, 3, PLAN), batch_at(STREAM, 3, PLAN))
    assert not torch.equal(batch_at(STREAM, 3, PLAN), batch_at(STREAM, 4, PLAN))
    assert batch_at(STREAM, 0, PLAN).shape == (2, 9)


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    """Stopped after step 3 and restarted, training ends with exactly the weights of an uninterrupted run."""
    straight = new_model(tiny_config(), seed=1)
    train(straight, STREAM, PLAN, state_path=tmp_path / "straight.pt")
    resumed = new_model(tiny_config(), seed=1)
    with pytest.raises(KeyboardInterrupt):
        train(resumed, STREAM, PLAN, state_path=tmp_path / "resumed.pt", progress=StopAfter(3))
    assert torch.load(tmp_path / "resumed.pt", weights_only=True)["step"] == 2
    fresh = new_model(tiny_config(), seed=1)
    result = train(fresh, STREAM, PLAN, state_path=tmp_path / "resumed.pt")
    assert result.steps == 4
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name


def test_recipe_key_follows_every_setting():
    """Rescaling a recipe to another budget changes its steps and its cache key; the same recipe keeps both."""
    full = RECIPES["full"]
    doubled = full.scaled(full.minutes * 2)
    assert doubled.small_steps == 2 * full.small_steps and doubled.key() != full.key()
    assert full.key() == RECIPES["full"].key() and full.key().startswith("full-")


def test_comparison_members_change_one_thing_each():
    """small-unrelated differs from small in seed and data half; small-othertok in tokenizer (and fewer steps)."""
    by_name = {m.name: m for m in members(RECIPES["full"])}
    small, unrelated, othertok = by_name["small"], by_name["small-unrelated"], by_name["small-othertok"]
    assert (unrelated.shape, unrelated.tokenizer, unrelated.steps) == (small.shape, small.tokenizer, small.steps)
    assert unrelated.seed != small.seed and unrelated.half != small.half
    assert (othertok.shape, othertok.half, othertok.seed) == (small.shape, small.half, small.seed)
    assert othertok.tokenizer != small.tokenizer


def test_signature_compares_tokenizers_only_when_both_name_one():
    """Different tokenizer fingerprints are a mismatch; an unnamed side is not."""
    base = ModelSignature(4, 2, 64, 1e4, (("rope_type", "default"),), "m", "vocab-a")
    other = ModelSignature(4, 2, 64, 1e4, (("rope_type", "default"),), "m", "vocab-b")
    unnamed = ModelSignature(4, 2, 64, 1e4, (("rope_type", "default"),), "m")
    assert "tokenizer" in (base.mismatch(other) or "")
    assert base.mismatch(unnamed) is None and base.mismatch(base) is None
    assert ModelSignature.from_dict(base.to_dict()) == base


def test_importing_the_family_package_does_not_import_torch():
    """`import agentkv.embedded.family` stays cheap: torch, transformers and tokenizers load when training starts."""
    import subprocess
    import sys

    code = ("import sys, agentkv.embedded.family; "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
