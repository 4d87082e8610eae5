"""What a KV cache belongs to: the model geometry that built it.

A ``ModelSignature`` is plain data (no torch), so it travels in manifests and log events::

    sig = ModelSignature.from_config(model.config, model_id="Qwen/Qwen3-14B")
    sig.mismatch(other)      # None when compatible, else a one-line reason
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

RopeScaling = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class ModelSignature:
    """The geometry of one model's KV cache.

    ``rope_scaling`` holds the rope parameters other than ``rope_theta`` (``rope_type`` included) as
    sorted ``(key, value)`` pairs, so the signature stays hashable and compares exactly. ``model_id``
    is informative; it is compared only when both sides name one. ``tokenizer`` is a fingerprint of
    the vocabulary (``config.tokenizer_fingerprint``, set by ``agentkv.embedded.engine.models.load_model``): two
    caches built from different token ids never match, so it too is compared when both sides name one.

        ModelSignature(num_layers=40, kv_heads=8, head_dim=128, rope_theta=1e6, model_id="Qwen/Qwen3-14B")
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling = ()
    model_id: str = ""
    tokenizer: str = ""

    @classmethod
    def from_config(cls, config: Any, model_id: str = "") -> ModelSignature:
        """Read the signature from a transformers config (v5 ``rope_parameters`` or v4 fields)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        rope = dict(getattr(text, "rope_parameters", None) or {})
        if not rope:
            rope = dict(getattr(text, "rope_scaling", None) or {})
            rope["rope_theta"] = getattr(text, "rope_theta", 10000.0)
        theta = float(rope.pop("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        ident = model_id or str(getattr(config, "_name_or_path", "") or "")
        vocab = str(getattr(config, "tokenizer_fingerprint", "") or "")
        return cls(text.num_hidden_layers, kv_heads, head_dim, theta, _canonical(rope), ident, vocab)

    @property
    def rope_type(self) -> str:
        """The rope type (``default``, ``llama3``, ``yarn`` ...)."""
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    def geometry(self) -> tuple[int, int, int, float, RopeScaling]:
        """Everything but the model id."""
        return (self.num_layers, self.kv_heads, self.head_dim, self.rope_theta, self.rope_scaling)

    def mismatch(self, other: ModelSignature) -> str | None:
        """None when ``other`` describes the same cache geometry (and model, when both name one)."""
        if self.geometry() != other.geometry():
            return f"cache geometry {other.describe()} is not {self.describe()}"
        if self.model_id and other.model_id and self.model_id != other.model_id:
            return f"model {other.model_id!r} is not {self.model_id!r}"
        return self.tokenizer_mismatch(other)

    def tokenizer_mismatch(self, other: ModelSignature) -> str | None:
        """None unless both sides name a tokenizer and they differ (the token ids mean different text)."""
        if self.tokenizer and other.tokenizer and self.tokenizer != other.tokenizer:
            return f"tokenizer {other.tokenizer!r} is not {self.tokenizer!r}"
        return None

    def describe(self) -> str:
        """A short human-readable form for errors and tables."""
        scaling = f", {self.rope_type}" if self.rope_type != "default" else ""
        return (
            f"{self.model_id or '?'}[L={self.num_layers}, kv={self.kv_heads}, d={self.head_dim}, "
            f"theta={self.rope_theta:g}{scaling}]"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (rope scaling as an object)."""
        data = asdict(self)
        data["rope_scaling"] = dict(self.rope_scaling)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSignature:
        """Inverse of :meth:`to_dict`."""
        fields = dict(data)
        fields["rope_scaling"] = _canonical(fields.get("rope_scaling") or {})
        return cls(**fields)


@dataclass(frozen=True)
class SignaturePair:
    """The source cache a mapper reads and the target cache it writes."""

    source: ModelSignature
    target: ModelSignature

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"source": self.source.to_dict(), "target": self.target.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SignaturePair:
        """Inverse of :meth:`to_dict`."""
        return cls(ModelSignature.from_dict(data["source"]), ModelSignature.from_dict(data["target"]))


def _canonical(rope: Mapping[str, Any]) -> RopeScaling:
    """Sorted, JSON-round-trippable ``(key, value)`` pairs."""
    plain = json.loads(json.dumps(dict(rope), default=float))
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in plain.items()))
