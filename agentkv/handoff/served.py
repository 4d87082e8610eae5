"""Handoff between two served vLLM models through :class:`~agentkv.vllm_plugin.connector.AgentKVConnector`: the client's
half, as pure functions of plain data (the Session's escalation step does the two HTTP calls).

At an escalation that would otherwise be cold, the Session asks fast to export the conversation's prefix (a
one-token request it mostly serves from its prefix cache), asks the quality gate whether the pair may be mapped
(:class:`MapperSummary` gives it the mapper's figures without torch), and sends the escalated request with the
import parameters under the handoff salt. The slow server maps on its own device; the client moves no tensors.

    summary = MapperSummary.read("mappers/fast-slow")
    plan = choose_handoff(summary, 0.95)
    body = export_body("fast", previous_payload, tenant_salt)            # POST to fast
    kwargs, salt = import_request(kwargs, export_id, summary, tenant_salt, mapper_name="fast")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from agentkv.handoff.errors import MapperFileError, NotMappableError
from agentkv.handoff.signature import SignaturePair
from agentkv.wire.kv_transfer import export_params, handoff_salt, import_params, mapper_digest

if TYPE_CHECKING:
    import torch

    from agentkv.handoff.cache import KVCache
    from agentkv.tokens import Payload

__all__ = ["MapperSummary", "cold_reason", "export_body", "import_request"]


@dataclass
class MapperSummary:
    """What the gate and the wire need of a saved mapper (its manifest and files' digest), read without torch.

    It satisfies :class:`~agentkv.handoff.protocol.KVMapper` for :func:`~agentkv.handoff.plan.choose_handoff`;
    its ``map`` refuses: the server's connector maps, with the mapper it loaded from the same folder.
    """

    name: str
    path: str
    digest: str
    pair: SignaturePair | None
    cosine: float | None

    @classmethod
    def read(cls, path: str | Path) -> MapperSummary:
        """Read ``manifest.json`` (backend, signatures, held-out figures) and digest the folder's files."""
        from agentkv.handoff.manifest import check_evaluation, signature_pair
        from agentkv.handoff.registry import read_manifest

        manifest = read_manifest(path)
        backend = manifest.get("backend")
        if not isinstance(backend, str):
            raise MapperFileError(f"{path}/manifest.json: field 'backend' must name a backend, not {backend!r}")
        check_evaluation(manifest, str(path))
        pair = signature_pair(manifest, str(path)) if "signatures" in manifest else None
        cosine = manifest.get("evaluation", {}).get("attention_cosine")
        return cls(backend, str(path), mapper_digest(path), pair, None if cosine is None else float(cosine))

    @property
    def signature_pair(self) -> SignaturePair | None:
        return self.pair

    @property
    def moves_kv(self) -> bool:
        return self.name != "replay"

    @property
    def attention_cosine(self) -> float | None:
        return self.cosine

    def map(self, cache: KVCache, target_positions: torch.Tensor | None = None) -> KVCache:
        raise NotMappableError("a mapper summary maps nothing: the target server's connector maps")

    def save(self, path: str | Path) -> None:
        raise NotMappableError("a mapper summary is read from a mapper folder, not saved")

    @classmethod
    def load(cls, path: str | Path) -> MapperSummary:
        return cls.read(path)


def cold_reason(*, warmed: bool, held_tokens: int | None, warmed_tokens: int | None,
                block_size: int | None) -> str | None:
    """Why this escalation would be a cold prefill on slow (so a handoff pays), or None when slow holds the prefix.

    ``warmed``: warm-ahead sent this conversation's prefix to slow; ``held_tokens`` / ``warmed_tokens`` /
    ``block_size``: the ledger's view of that warm (None when no ledger follows slow, or it cannot tell).
    """
    if not warmed:
        return "no warm-ahead reached slow"
    if held_tokens is None or warmed_tokens is None or not block_size:
        return None
    whole = warmed_tokens // block_size * block_size
    return None if held_tokens >= whole else f"slow holds {held_tokens} of the {whole} warmed tokens: evicted"


def export_body(model: str, payload: Payload, salt: str | None) -> dict[str, Any]:
    """A one-token chat request that renders ``payload``'s prompt on ``model`` and asks the server to export it."""
    body: dict[str, Any] = {"model": model, "messages": list(payload.messages or ()), "max_tokens": 1,
                            "kv_transfer_params": export_params()}
    if payload.tools:
        body["tools"] = list(payload.tools)
    if payload.tool_choice is not None:
        body["tool_choice"] = payload.tool_choice
    if payload.template_kwargs:
        body["chat_template_kwargs"] = dict(payload.template_kwargs)
    if salt is not None:
        body["cache_salt"] = salt
    return body


def import_request(kwargs: Mapping[str, Any], export_id: str, mapper: MapperSummary | None, salt: str | None,
                   *, mapper_name: str | None, raw: bool = False) -> tuple[dict[str, Any], str | None]:
    """The escalated request's kwargs naming the export, and the ``cache_salt`` it must carry.

    ``raw``: ``kwargs`` is an OpenAI body as it goes on the wire (the transport, the gateway), where
    ``kv_transfer_params`` is a top-level field; litellm kwargs carry it in ``extra_body``.

    A mapped import goes under :func:`~agentkv.wire.kv_transfer.handoff_salt` of the tenant's salt and the mapper, so its
    approximate blocks never serve the tenant's exact requests; an identity import (``mapper`` None) keeps the salt.
    """
    params = import_params(export_id, mapper_name if mapper is not None else None)
    new_salt = salt if mapper is None else handoff_salt(salt, mapper.digest)
    if raw:
        return {**kwargs, "kv_transfer_params": params}, new_salt
    extra = {**dict(kwargs.get("extra_body") or {}), "kv_transfer_params": params}
    return {**kwargs, "extra_body": extra}, new_salt
