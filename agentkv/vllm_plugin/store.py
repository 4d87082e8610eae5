"""The export store: a folder of KV exports, each a safetensors file plus a JSON manifest, named by digests.

One export is the KV of a prompt prefix in a layout-independent form::

    <export id>.safetensors   keys.<layer>, values.<layer>: [tokens, kv_heads, head_dim] (keys post-RoPE),
                              token_ids, positions: [tokens] int64
    <export id>.json          format, model signature, salt digest, token ids, the tensor file's sha256 and size

The id is a digest of (signature, salt digest, token ids), so file names carry no tenant and no text. The
manifest is written last (rename), so a manifest means a complete export. The store is bounded in bytes,
least recently used first out; an import deletes what it loaded; an export older than ``max_age_s`` is stale.

    store = ExportStore(root, max_bytes=2 << 30)
    found = store.lookup(export_id)          # Lookup(manifest, reason): None and why when unusable
    keys, values, positions = store.load(found.manifest, start, end)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["FORMAT_VERSION", "ExportError", "ExportManifest", "ExportStore", "Lookup", "evictions", "export_id"]

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_MAX_AGE_S = 3600.0


class ExportError(RuntimeError):
    """An export could not be read back as its manifest describes (missing, altered, or misshapen)."""


@dataclass(frozen=True)
class ExportManifest:
    """What an export holds. ``signature`` is a :meth:`ModelSignature.to_dict`; ``salt`` a salt digest."""

    export_id: str
    model: str
    signature: dict[str, Any]
    salt: str
    token_ids: tuple[int, ...]
    num_layers: int
    dtype: str
    created_at: float
    sha256: str = ""
    nbytes: int = 0
    format_version: int = FORMAT_VERSION

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> str:
        body = asdict(self)
        body["token_ids"] = list(self.token_ids)
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ExportManifest:
        """Parse a manifest; anything not shaped as written raises :class:`ExportError`."""
        try:
            body = json.loads(text)
            manifest = cls(**{**body, "token_ids": tuple(int(t) for t in body["token_ids"])})
        except (ValueError, TypeError, KeyError) as error:
            raise ExportError(f"unreadable export manifest: {type(error).__name__}") from error
        if manifest.format_version != FORMAT_VERSION:
            raise ExportError(f"export format {manifest.format_version!r}, this reader knows {FORMAT_VERSION}")
        return manifest


@dataclass(frozen=True)
class Lookup:
    """An export found usable (``manifest``), or None and the reason."""

    manifest: ExportManifest | None
    reason: str


def export_id(signature: dict[str, Any], salt: str, token_ids: Sequence[int]) -> str:
    """The digest an export of ``token_ids`` by this model, under this salt digest, is stored as."""
    digest = hashlib.sha256(json.dumps(signature, sort_keys=True).encode() + b"\x00" + salt.encode() + b"\x00")
    digest.update(b",".join(str(int(t)).encode() for t in token_ids))
    return digest.hexdigest()[:32]


def evictions(entries: Iterable[tuple[str, int, float]], max_bytes: int) -> list[str]:
    """Ids to delete so the rest fit ``max_bytes``: least recently used first. entries: (id, bytes, last used)."""
    ordered = sorted(entries, key=lambda entry: entry[2])
    total = sum(size for _, size, _ in ordered)
    doomed: list[str] = []
    for ident, size, _ in ordered:
        if total <= max_bytes:
            break
        doomed.append(ident)
        total -= size
    return doomed


class ExportStore:
    """A folder of exports; every method is safe to call from the scheduler and the worker processes at once."""

    def __init__(self, root: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_age_s, self.clock = int(max_bytes), float(max_age_s), clock

    def _manifest_path(self, ident: str) -> Path:
        return self.root / f"{ident}.json"

    def _tensor_path(self, ident: str) -> Path:
        return self.root / f"{ident}.safetensors"

    # ----------------------------------------------------------------- reading

    def lookup(self, ident: str) -> Lookup:
        """The export's manifest if it is present, readable and fresh (its use time is refreshed for the LRU)."""
        path = self._manifest_path(ident)
        try:
            manifest = ExportManifest.from_json(path.read_text())
        except FileNotFoundError:
            return Lookup(None, "no such export")
        except (OSError, ExportError) as error:
            return Lookup(None, f"unreadable manifest: {error}")
        if manifest.export_id != ident:
            return Lookup(None, "manifest names another export")
        if self.clock() - manifest.created_at > self.max_age_s:
            self.delete(ident)
            return Lookup(None, f"stale: older than {self.max_age_s:.0f} s")
        _touch(path)
        return Lookup(manifest, "found")

    def load(self, manifest: ExportManifest, start: int, end: int,
             device: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Tokens ``[start, end)`` of every layer: keys, values [end-start, kv_heads, head_dim]; positions [end-start].

        The tensor file's sha256 and the token ids are checked against the manifest first (:class:`ExportError`).
        """
        from safetensors.torch import load

        path = self._tensor_path(manifest.export_id)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ExportError(f"export tensors unreadable: {type(error).__name__}") from error
        if hashlib.sha256(data).hexdigest() != manifest.sha256:
            raise ExportError("export tensors do not match their manifest's sha256")
        tensors = load(data)
        if tensors["token_ids"].tolist() != list(manifest.token_ids):
            raise ExportError("export token ids do not match their manifest")
        window = slice(start, end)
        keys = [tensors[f"keys.{i}"][window].to(device) for i in range(manifest.num_layers)]
        values = [tensors[f"values.{i}"][window].to(device) for i in range(manifest.num_layers)]
        return keys, values, tensors["positions"][window].to(device)

    # ----------------------------------------------------------------- writing

    def write(self, manifest: ExportManifest, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
              positions: torch.Tensor) -> ExportManifest:
        """Store one export (keys/values per layer: [tokens, kv_heads, head_dim]), then evict down to ``max_bytes``."""
        import torch
        from safetensors.torch import save

        tensors = {f"keys.{i}": k.detach().to("cpu").contiguous() for i, k in enumerate(keys)}
        tensors.update({f"values.{i}": v.detach().to("cpu").contiguous() for i, v in enumerate(values)})
        tensors["token_ids"] = torch.tensor(manifest.token_ids, dtype=torch.int64)
        tensors["positions"] = positions.detach().to("cpu", torch.int64).contiguous()
        data = save(tensors, metadata={"format_version": str(FORMAT_VERSION), "export_id": manifest.export_id})
        final = ExportManifest(**{**asdict(manifest), "token_ids": manifest.token_ids,
                                  "sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data)})
        _write_atomically(self._tensor_path(manifest.export_id), data)
        _write_atomically(self._manifest_path(manifest.export_id), final.to_json().encode())
        self.evict()
        return final

    def delete(self, ident: str) -> None:
        """Remove an export (manifest first, so no reader sees half of one)."""
        for path in (self._manifest_path(ident), self._tensor_path(ident)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def entries(self) -> list[tuple[str, int, float]]:
        """``(id, bytes on disk, last used)`` of every export present."""
        found = []
        for manifest in self.root.glob("*.json"):
            ident = manifest.stem
            try:
                size = manifest.stat().st_size + self._tensor_path(ident).stat().st_size
                found.append((ident, size, manifest.stat().st_mtime))
            except FileNotFoundError:
                continue
        return found

    def evict(self) -> list[str]:
        """Delete least recently used exports until the store fits ``max_bytes``; returns their ids."""
        doomed = evictions(self.entries(), self.max_bytes)
        for ident in doomed:
            self.delete(ident)
        return doomed

    @property
    def nbytes(self) -> int:
        return sum(size for _, size, _ in self.entries())


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
