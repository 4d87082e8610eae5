"""Rotary position embedding: strip it from keys, put it back, with each model's own frequencies.

Keys in a cache are post-RoPE: ``k = x * cos + rotate_half(x) * sin``, a rotation (times the rope
type's ``attention_scaling``) of the position-free key ``x``. A mapper fits in position-free space and
re-applies the target's RoPE at the target positions, so a map fitted on short sequences holds at 32K.

cos/sin come from the model's own rotary module (``model.model.rotary_emb``), so scaled variants
(Llama 3.1 ``llama3``, ``linear``, ``yarn``) are handled exactly. A saved mapper keeps the module's
``inv_freq`` and ``attention_scaling`` in a :class:`RopeTable` and reproduces its cos/sin bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""Rope types whose frequencies do not depend on sequence length (what a RopeTable can store)."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` over the last dim, as in transformers' Llama/Qwen attention."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate position-free keys into place.

    x: [batch, heads, seq, head_dim]; cos, sin: [batch, seq, head_dim] -> [batch, heads, seq, head_dim]
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def inverse_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the inverse rotation, the attention scaling divided out: ``apply_rope`` with these strips.

    cos, sin: [batch, seq, head_dim] -> two [batch, seq, head_dim]
    """
    norm = cos * cos + sin * sin  # attention_scaling² at every position
    return cos / norm, -sin / norm


def strip_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`apply_rope`: rotate back and divide out the attention scaling.

    x: [batch, heads, seq, head_dim]; cos, sin: [batch, seq, head_dim] -> [batch, heads, seq, head_dim]
    """
    return apply_rope(x, *inverse_cos_sin(cos, sin))


def rotary_module(model: Any) -> Any:
    """The model's rotary embedding module (``model.model.rotary_emb`` for a CausalLM)."""
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise TypeError(f"{type(model).__name__} has no rotary_emb module; only RoPE models can be mapped")
    return rotary


def model_cos_sin(
    model: Any, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin from the model's own rotary module. positions: [batch, seq] -> two [batch, seq, head_dim]."""
    probe = torch.empty(0, dtype=dtype, device=positions.device)
    return rotary_module(model)(probe, positions)


@dataclass(frozen=True)
class RopeTable:
    """A model's static rotary frequencies, enough to rebuild its cos/sin without the model.

    inv_freq: [head_dim // 2] float32; attention_scaling: the factor cos and sin are multiplied by.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0

    @classmethod
    def from_model(cls, model: Any) -> RopeTable:
        """Read the frequencies of a model whose rope type is static (see :data:`STATIC_ROPE_TYPES`)."""
        rotary = rotary_module(model)
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise NotImplementedError(
                f"rope type {rope_type!r} changes with sequence length; supported: {sorted(STATIC_ROPE_TYPES)}"
            )
        inv_freq = rotary.inv_freq.detach().to("cpu", torch.float32).clone()
        return cls(inv_freq, float(rotary.attention_scaling))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin exactly as the rotary module computes them. positions: [batch, seq] -> [batch, seq, head_dim]."""
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions[..., None].float() * inv_freq  # (B, T) -> (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D/2) -> (B, T, D)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def strip(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Position-free keys. x: [batch, heads, seq, head_dim], positions: [batch, seq]; computed in float32."""
        cos, sin = self.cos_sin(positions)
        return strip_rope(x.float(), cos, sin).to(x.dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys. x: [batch, heads, seq, head_dim], positions: [batch, seq]; computed in float32."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x.float(), cos, sin).to(x.dtype)

    def equals(self, other: RopeTable) -> bool:
        """Same frequencies and scaling."""
        same_freq = self.inv_freq.shape == other.inv_freq.shape and bool(torch.equal(self.inv_freq, other.inv_freq))
        return same_freq and self.attention_scaling == other.attention_scaling
