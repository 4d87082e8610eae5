"""What runs inside a vLLM server: :class:`~agentkv.vllm_plugin.connector.AgentKVConnector`, a v1 KV connector for
cross-model KV handoff, and the plain helpers a client needs to talk to it.

Importing this package does not import vLLM or torch; only ``agentkv.vllm_plugin.connector`` (which vLLM imports in
its own processes) does.

    config = connector_config("/var/agentkv/kv", mappers={"fast": "mappers/fast-slow"})
    VLLMServer(python, slow_model, kv_transfer=config, extra_env={"PYTHONPATH": str(connector_pythonpath())})

    body["kv_transfer_params"] = export_params()                      # on fast: write the prompt's KV
    export_id, tokens = export_result(answer["kv_transfer_params"])
    body["kv_transfer_params"] = import_params(export_id, mapper="fast")
    body["cache_salt"] = handoff_salt(tenant_salt, mapper_digest("mappers/fast-slow"))   # on slow
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any, Mapping

from agentkv.wire.kv_transfer import (
    KEY,
    TransferRequest,
    export_params,
    export_result,
    handoff_salt,
    import_params,
    import_result,
    mapper_digest,
    parse_request,
    salt_digest,
)

__all__ = ["CONNECTOR", "KEY", "MODULE", "TransferRequest", "connector_config", "connector_pythonpath",
           "export_params", "export_result", "handoff_salt", "import_params", "import_result", "mapper_digest",
           "parse_request",
           "salt_digest"]

CONNECTOR = "AgentKVConnector"
MODULE = "agentkv.vllm_plugin.connector"


def connector_config(store: str | Path, *, mappers: Mapping[str, str | Path] | None = None,
                     max_bytes: int | None = None, max_age_s: float | None = None,
                     role: str = "kv_both") -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that loads the connector (a failed load re-prefills: ``recompute``)."""
    extra: dict[str, Any] = {"store": str(store)}
    if mappers:
        extra["mappers"] = {name: str(path) for name, path in mappers.items()}
    if max_bytes is not None:
        extra["max_bytes"] = int(max_bytes)
    if max_age_s is not None:
        extra["max_age_s"] = float(max_age_s)
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def connector_pythonpath() -> Path:
    """A folder holding only a link to this ``agentkv`` package: the vLLM venv's ``PYTHONPATH`` entry.

    vLLM's interpreter needs agentkv importable in its engine and worker processes; a folder with nothing else
    in it cannot shadow a module of vLLM's (a checkout's ``tests/`` or ``examples/`` could).
    """
    package = Path(__file__).resolve().parent.parent
    tag = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"agentkv-vllm-path-{tag}"
    folder.mkdir(exist_ok=True)
    link = folder / "agentkv"
    if not link.exists():
        try:
            link.symlink_to(package, target_is_directory=True)
        except FileExistsError:  # another process made it first
            pass
    return folder
