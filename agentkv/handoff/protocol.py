"""The ``KVMapper`` plug point: anything with these members is a KV mapper backend.

Third-party backends need no base class; they register a factory (usually the class itself) under a
name, in code with :func:`agentkv.handoff.register_mapper` or in their package metadata::

    [project.entry-points."agentkv.mappers"]
    mine = "my_package.mapper:MyMapper"
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from agentkv.handoff.errors import SignatureMismatchError
from agentkv.handoff.signature import SignaturePair

REPLAY = "replay"
"""The default backend: no bytes move; the target prefills the tokens again, its prefix cache doing the work."""

DEFAULT_MIN_ATTENTION_COSINE = 0.95
"""The quality gate's floor (:func:`~agentkv.handoff.plan.choose_handoff`): a mapper whose held-out attention-output
cosine is lower replays."""

if TYPE_CHECKING:
    import torch

    from agentkv.handoff.cache import KVCache


@runtime_checkable
class KVMapper(Protocol):
    """Turns one model's KV cache into another model's.

    - ``name``: the registry name the mapper was created under (written to its manifest).
    - ``signature_pair``: the source cache it reads and the target cache it writes; None for
      backends that accept any model (``replay``, an unbound ``identity``).
    - ``moves_kv``: False for ``replay``, whose handoff sends tokens and lets the target's prefix
      cache do the work; ``map`` then raises :class:`~agentkv.handoff.errors.NotMappableError`.
    - ``attention_cosine``: held-out attention-output cosine between mapped and true target caches,
      what the quality gate reads; None when never measured.
    """

    name: str

    @property
    def signature_pair(self) -> SignaturePair | None: ...

    @property
    def moves_kv(self) -> bool: ...

    @property
    def attention_cosine(self) -> float | None: ...

    def map(self, cache: KVCache, target_positions: torch.Tensor | None = None) -> KVCache:
        """Map ``cache`` (source signature) to a target cache at ``target_positions`` [batch, seq]
        (default: the source positions)."""
        ...

    def save(self, path: str | Path) -> None:
        """Write the mapper to directory ``path`` (``manifest.json`` plus safetensors weights)."""
        ...

    @classmethod
    def load(cls, path: str | Path) -> KVMapper:
        """Read a mapper written by :meth:`save`; never unpickles."""
        ...


def check_source(pair: SignaturePair | None, cache: KVCache) -> None:
    """Raise :class:`SignatureMismatchError` unless ``cache`` was built by the pair's source model."""
    if pair is None:
        return
    reason = pair.source.mismatch(cache.signature)
    if reason is not None:
        raise SignatureMismatchError(
            f"this mapper maps {pair.source.describe()} -> {pair.target.describe()}; "
            f"refusing a cache from another model: {reason}"
        )
