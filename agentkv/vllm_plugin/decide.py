"""What the connector's scheduler side decides, as pure functions of plain data: how many tokens an import loads.

A request that names an export loads it only when every check passes; the first failing check is the reason
it re-prefills instead (a normal request, never an error):

- the export is present, readable and fresh (:meth:`ExportStore.lookup`);
- it was written by the model this server runs (no mapper), or by the named mapper's source model, and the
  mapper's target is this model;
- the request's ``cache_salt`` is the one the loaded blocks may live under: the exporter's own salt for an
  exact (same-model) import, the :func:`~agentkv.wire.kv_transfer.handoff_salt` of that salt and the mapper for
  a mapped one, so approximate blocks can never serve an exact-prefix request;
- the export's tokens are a prefix of the prompt for at least one whole block (the load is block-aligned and
  leaves the prompt's last token to compute).

    plan = plan_import(ImportInputs(ask, lookup, prompt, salt, signature, mappers, block_size=128))
    plan.tokens    # block-aligned count of prompt tokens to load; 0 with plan.reason when none
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from agentkv.handoff.signature import ModelSignature, SignaturePair
from agentkv.prefix import common_prefix
from agentkv.wire.kv_transfer import TransferRequest, handoff_salt_from_digest, salt_digest
from agentkv.vllm_plugin.store import ExportManifest, Lookup

__all__ = ["ImportInputs", "ImportPlan", "MapperEntry", "common_prefix", "plan_import"]


@dataclass(frozen=True)
class MapperEntry:
    """A mapper the server was configured with: its directory, identity digest and signature pair."""

    path: str
    digest: str
    pair: SignaturePair


@dataclass(frozen=True)
class ImportInputs:
    """Everything an import decision looks at."""

    ask: TransferRequest
    found: Lookup
    prompt: Sequence[int]
    salt: str | None
    signature: ModelSignature
    mappers: Mapping[str, MapperEntry] = field(default_factory=dict)
    block_size: int = 128


@dataclass(frozen=True)
class ImportPlan:
    """Load tokens ``[0, tokens)`` of the prompt from export ``export_id`` (through ``mapper`` when named)."""

    tokens: int
    reason: str
    export_id: str | None = None
    mapper: str | None = None

    @property
    def loads(self) -> bool:
        return self.tokens > 0


Check = Callable[[ImportInputs, ExportManifest], Union[str, None]]


def _model(inputs: ImportInputs, manifest: ExportManifest) -> str | None:
    exported = ModelSignature.from_dict(manifest.signature)
    if inputs.ask.mapper is None:
        reason = inputs.signature.mismatch(exported)
        return None if reason is None else f"exported by another model ({reason}) and no mapper named"
    entry = inputs.mappers.get(inputs.ask.mapper)
    if entry is None:
        return f"no mapper configured for {inputs.ask.mapper!r}"
    reason = entry.pair.source.mismatch(exported)
    if reason is not None:
        return f"mapper {inputs.ask.mapper!r} does not read this export: {reason}"
    reason = entry.pair.target.mismatch(inputs.signature)
    return None if reason is None else f"mapper {inputs.ask.mapper!r} does not write this model: {reason}"


def _salt(inputs: ImportInputs, manifest: ExportManifest) -> str | None:
    if inputs.ask.mapper is None:
        same = salt_digest(inputs.salt) == manifest.salt
        return None if same else "the request's cache_salt is not the exporter's"
    entry = inputs.mappers[inputs.ask.mapper]
    if inputs.salt == handoff_salt_from_digest(manifest.salt, entry.digest):
        return None
    return "mapped KV loads only under its handoff salt; the request carries another cache_salt"


CHECKS: tuple[Check, ...] = (_model, _salt)


def plan_import(inputs: ImportInputs) -> ImportPlan:
    """The block-aligned prompt prefix this request loads from its export, or 0 and the first failing check."""
    ask, manifest = inputs.ask, inputs.found.manifest
    if manifest is None:
        return ImportPlan(0, f"export unusable: {inputs.found.reason}", ask.import_id, ask.mapper)
    for check in CHECKS:
        reason = check(inputs, manifest)
        if reason is not None:
            return ImportPlan(0, reason, ask.import_id, ask.mapper)
    shared = min(common_prefix(manifest.token_ids, inputs.prompt), len(inputs.prompt) - 1)
    tokens = shared // inputs.block_size * inputs.block_size
    if tokens == 0:
        return ImportPlan(0, f"the export shares {shared} prompt tokens: less than a {inputs.block_size}-token block",
                          ask.import_id, ask.mapper)
    kind = f"mapped by {ask.mapper!r}" if ask.mapper else "exact"
    return ImportPlan(tokens, f"{kind}: {tokens} of {shared} shared tokens (block-aligned)", ask.import_id, ask.mapper)
