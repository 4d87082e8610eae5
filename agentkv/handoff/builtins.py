"""The two mappers that need no calibration: ``replay`` (the default) and ``identity``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentkv.handoff.errors import NotMappableError, SignatureMismatchError
from agentkv.handoff.manifest import signature
from agentkv.handoff.protocol import check_source
from agentkv.handoff.registry import MANIFEST, read_manifest
from agentkv.handoff.signature import ModelSignature, SignaturePair

if TYPE_CHECKING:
    import torch

    from agentkv.handoff.cache import KVCache


@dataclass(frozen=True)
class ReplayMapper:
    """Moves no bytes: the handoff sends the token prefix and the target's prefix cache does the work.

    Any source/target pair works, so ``signature_pair`` is None and ``map`` is not applicable.
    """

    name: str = "replay"

    @property
    def signature_pair(self) -> SignaturePair | None:
        return None

    @property
    def moves_kv(self) -> bool:
        return False

    @property
    def attention_cosine(self) -> float | None:
        return None

    def map(self, cache: KVCache, target_positions: torch.Tensor | None = None) -> KVCache:
        raise NotMappableError("the replay backend moves tokens, not KV: re-prefill them on the target")

    def save(self, path: str | Path) -> None:
        _write_manifest(path, {"backend": self.name})

    @classmethod
    def load(cls, path: str | Path) -> ReplayMapper:
        read_manifest(path)
        return cls()


@dataclass(frozen=True)
class IdentityMapper:
    """Hands the cache over unchanged: source and target are the same model (replicas).

    ``signature`` binds it to one model; unbound, it accepts any cache. Positions must not move,
    since no RoPE geometry is known to re-rotate keys with.

        IdentityMapper(ModelSignature.from_config(model.config))
    """

    signature: ModelSignature | None = None
    name: str = "identity"

    @property
    def signature_pair(self) -> SignaturePair | None:
        return None if self.signature is None else SignaturePair(self.signature, self.signature)

    @property
    def moves_kv(self) -> bool:
        return True

    @property
    def attention_cosine(self) -> float | None:
        return 1.0

    def map(self, cache: KVCache, target_positions: torch.Tensor | None = None) -> KVCache:
        """The same cache. keys/values: [batch, kv_heads, seq, head_dim]; positions unchanged."""
        check_source(self.signature_pair, cache)
        if target_positions is not None and not bool((target_positions == cache.positions).all()):
            raise SignatureMismatchError("the identity mapper cannot move tokens to other positions")
        return cache

    def save(self, path: str | Path) -> None:
        signature = None if self.signature is None else self.signature.to_dict()
        _write_manifest(path, {"backend": self.name, "signature": signature})

    @classmethod
    def load(cls, path: str | Path) -> IdentityMapper:
        data = read_manifest(path).get("signature")
        return cls(None if data is None else signature(data, "signature", str(path)))


def _write_manifest(path: str | Path, manifest: dict[str, object]) -> None:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
