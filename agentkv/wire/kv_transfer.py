"""The wire format between a client and :class:`~agentkv.vllm_plugin.connector.AgentKVConnector`: plain dicts and digests.

A request asks through its body's ``kv_transfer_params`` (vLLM hands them to the connector untouched)::

    {"agentkv": {"export": true}}                               # write this prompt's KV to the store
    {"agentkv": {"import": "<export id>"}}                      # load an export of the same model (replica)
    {"agentkv": {"import": "<export id>", "mapper": "fast"}}    # map an export of model "fast" first

An export's answer carries ``{"agentkv": {"export_id": ..., "tokens": N}}`` in the response's
``kv_transfer_params``; an import's carries ``{"agentkv": {"imported": ..., "tokens": N, "reason": ...}}``, N the
tokens vLLM loaded (0 when the export was refused, or its load failed and was recomputed).

Mapped KV loads only under :func:`handoff_salt` of the exporter's salt and the mapper: a salt no ordinary
request carries, so an exact-prefix request never meets approximate blocks.

Pure functions, standard library only: this module runs inside vLLM's processes (:mod:`agentkv.vllm_plugin`) and in the
Session's handoff (:mod:`agentkv.handoff`), and sits below both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["KEY", "TransferRequest", "export_params", "export_result", "handoff_salt", "import_params",
           "import_result", "mapper_digest", "parse_request", "salt_digest"]

KEY = "agentkv"
"""The one key of ``kv_transfer_params`` this connector reads and writes."""

_SALT_DOMAIN = b"agentkv-handoff-salt/v1\x00"
_NO_SALT = b"agentkv-no-salt\x00"
_MAPPER_FILES = ("manifest.json", "weights.safetensors")


@dataclass(frozen=True)
class TransferRequest:
    """What one request asked of the connector: an export, an import (of ``import_id``, through ``mapper``), or both."""

    export: bool = False
    import_id: str | None = None
    mapper: str | None = None

    @property
    def wants_import(self) -> bool:
        return self.import_id is not None


def export_params() -> dict[str, Any]:
    """``kv_transfer_params`` asking the server to export the prompt's KV."""
    return {KEY: {"export": True}}


def import_params(export_id: str, mapper: str | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` asking the server to load export ``export_id`` (mapped by ``mapper``'s map if named)."""
    body: dict[str, Any] = {"import": export_id}
    if mapper is not None:
        body["mapper"] = mapper
    return {KEY: body}


def parse_request(params: Mapping[str, Any] | None) -> TransferRequest | None:
    """The request's ask, or None when it asks nothing of this connector (or asks in a shape it does not know)."""
    body = params.get(KEY) if isinstance(params, Mapping) else None
    if not isinstance(body, Mapping):
        return None
    export = body.get("export") is True
    import_id = body.get("import")
    mapper = body.get("mapper")
    if not (isinstance(import_id, str) and is_digest(import_id)):
        import_id = None
    if not isinstance(mapper, str) or not mapper:
        mapper = None
    if not export and import_id is None:
        return None
    return TransferRequest(export, import_id, mapper)


def export_result(params: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """``(export id, tokens)`` from a response's ``kv_transfer_params``, or None when nothing was exported."""
    body = params.get(KEY) if isinstance(params, Mapping) else None
    if not isinstance(body, Mapping):
        return None
    export_id, tokens = body.get("export_id"), body.get("tokens")
    if not isinstance(export_id, str) or not is_digest(export_id) or not isinstance(tokens, int):
        return None
    return export_id, tokens


def import_result(params: Mapping[str, Any] | None) -> tuple[int, str] | None:
    """``(tokens loaded, reason)`` from an import's answer, or None when the server said nothing of one."""
    body = params.get(KEY) if isinstance(params, Mapping) else None
    if not isinstance(body, Mapping) or "imported" not in body:
        return None
    tokens, reason = body.get("tokens"), body.get("reason")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return None
    return tokens, str(reason)[:200] if isinstance(reason, str) else ""


def is_digest(text: str) -> bool:
    """A lowercase hex digest of 16 to 64 characters (what export ids are; never a path)."""
    return 16 <= len(text) <= 64 and all(c in "0123456789abcdef" for c in text)


def salt_digest(salt: str | None) -> str:
    """What an export records of its request's ``cache_salt``: a digest, never the salt."""
    raw = _NO_SALT if salt is None else salt.encode()
    return hashlib.sha256(raw).hexdigest()


def handoff_salt(salt: str | None, mapper_id: str) -> str:
    """The ``cache_salt`` mapped KV lives under: one per (tenant salt, mapper), never equal to an ordinary salt.

    ``salt`` is the tenant's ordinary salt (None for none); ``mapper_id`` is :func:`mapper_digest` of the mapper.
    The connector derives it from the export's :func:`salt_digest`, so both sides agree without sharing the salt.
    """
    return handoff_salt_from_digest(salt_digest(salt), mapper_id)


def handoff_salt_from_digest(digest: str, mapper_id: str) -> str:
    """:func:`handoff_salt` from the salt's digest (what the connector knows)."""
    return "agentkv-handoff-" + hashlib.sha256(_SALT_DOMAIN + digest.encode() + b"\x00" + mapper_id.encode()).hexdigest()


def mapper_digest(path: str | Path) -> str:
    """A digest of a saved mapper's files (``manifest.json``, ``weights.safetensors`` when present): its identity."""
    folder = Path(path)
    digest = hashlib.sha256()
    for name in _MAPPER_FILES:
        file = folder / name
        if not file.is_file():
            continue
        digest.update(name.encode() + b"\x00")
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:32]
