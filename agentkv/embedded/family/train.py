"""Training one member: a Qwen3-architecture causal LM, AdamW on CPU, resumable and deterministic.

Batches are a pure function of ``(seed, step)``, so a run resumed from its last saved state takes the
same batches as one that was never interrupted. State (weights, optimizer, step, seconds) is saved to
``state_path`` every ``save_every`` steps; the caller saves the finished model.

    model = new_model(config, seed=0)
    result = train(model, stream, TrainPlan(steps=600, batch_size=16, seq_len=256, lr=2e-3, seed=0),
                   state_path=Path("small.state.pt"), progress=tqdm_steps)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional as F

__all__ = ["TrainPlan", "TrainResult", "batch_at", "heldout_loss", "learning_rate", "new_model", "train"]

StepProgress = Callable[[int, int, str], Any]
"""``progress(total_steps, done_steps, label)`` returns an object with ``update(n)``,
``set_postfix_str(text)`` and ``close()`` (a tqdm bar fits)."""


@dataclass(frozen=True)
class TrainPlan:
    """Optimizer steps of ``batch_size`` windows of ``seq_len`` tokens at peak ``lr`` (warmup, cosine decay)."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    save_every: int = 50
    weight_decay: float = 0.1


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports."""

    steps: int
    tokens: int
    seconds: float
    final_train_loss: float


def new_model(config: Any, *, seed: int) -> Any:
    """A freshly initialised ``Qwen3ForCausalLM`` for ``config``, identical for the same seed."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


def batch_at(stream: torch.Tensor, step: int, plan: TrainPlan) -> torch.Tensor:
    """The step's batch: ``[batch_size, seq_len + 1]`` windows of ``stream`` ([tokens] int64) at seeded offsets."""
    generator = torch.Generator().manual_seed(plan.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - plan.seq_len - 1, (plan.batch_size,), generator=generator)
    offsets = starts[:, None] + torch.arange(plan.seq_len + 1)  # (B,) -> (B, T+1)
    return stream[offsets]


def learning_rate(step: int, plan: TrainPlan) -> float:
    """Linear warmup over the first 10% of steps (at most 100), then cosine decay to a tenth."""
    warmup = max(1, min(100, plan.steps // 10))
    if step < warmup:
        return plan.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, plan.steps - warmup)
    return plan.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def next_token_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``. batch: [B, T+1]."""
    logits = model(batch[:, :-1]).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: Any, stream: torch.Tensor, seq_len: int, max_tokens: int) -> float:
    """Mean next-token loss over consecutive ``seq_len + 1`` windows of the first ``max_tokens`` of ``stream``."""
    was_training = model.training
    model.eval()
    count = max(1, min(len(stream), max_tokens) // (seq_len + 1))
    windows = stream[: count * (seq_len + 1)].reshape(count, seq_len + 1)
    losses = [float(next_token_loss(model, windows[i: i + 16])) * len(windows[i: i + 16])
              for i in range(0, count, 16)]
    model.train(was_training)
    return sum(losses) / count


def train(model: Any, stream: torch.Tensor, plan: TrainPlan, *, state_path: Path,
          progress: StepProgress | None = None) -> TrainResult:
    """Train ``model`` in place on ``stream`` ([tokens] int64), resuming from ``state_path`` if it exists."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=plan.weight_decay)
    start, seconds, loss = _resume(model, optimizer, state_path)
    bar = progress(plan.steps, start, "") if progress else None
    model.train()
    began = time.monotonic() - seconds
    for step in range(start, plan.steps):
        loss = _step(model, optimizer, batch_at(stream, step, plan), learning_rate(step, plan))
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.3f}")
        if (step + 1) % plan.save_every == 0 and step + 1 < plan.steps:
            _save_state(state_path, model, optimizer, step + 1, time.monotonic() - began, loss)
    if bar is not None:
        bar.close()
    model.eval()
    tokens = plan.steps * plan.batch_size * plan.seq_len
    return TrainResult(plan.steps, tokens, round(time.monotonic() - began, 1), round(loss, 4))


def _step(model: Any, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = next_token_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def _resume(model: Any, optimizer: torch.optim.Optimizer, path: Path) -> tuple[int, float, float]:
    if not path.exists():
        return 0, 0.0, float("nan")
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), float(state["seconds"]), float(state["loss"])


def _save_state(path: Path, model: Any, optimizer: torch.optim.Optimizer, step: int, seconds: float,
                loss: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "seconds": seconds, "loss": loss}, partial)
    os.replace(partial, path)
