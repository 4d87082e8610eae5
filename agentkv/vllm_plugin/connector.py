"""``AgentKVConnector``: a vLLM v1 KV connector that exports a prompt's KV and loads (mapped) exports back.

Loaded by vLLM, in both its engine (scheduler) process and its worker process::

    --kv-transfer-config '{"kv_connector": "AgentKVConnector", "kv_connector_module_path": "agentkv.vllm_plugin.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "/var/agentkv/kv", "mappers": {"fast": "/m/f2s"}}}'

(:func:`agentkv.vllm_plugin.connector_config` builds that dict.) This class only adapts vLLM's calls to the two
halves: :class:`~agentkv.vllm_plugin.scheduler.SchedulerSide` in the engine process and
:class:`~agentkv.vllm_plugin.worker.WorkerSide` in the worker, which share nothing but the step's
:class:`AgentKVMetadata`. It is the one module of agentkv that imports vLLM.

Extra config: ``store`` (a folder both servers reach), ``max_bytes`` (default 2 GiB), ``max_age_s`` (default
3600), ``mappers`` (source model name -> saved mapper directory, for the import side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from agentkv.handoff.signature import ModelSignature
from agentkv.vllm_plugin.decide import MapperEntry
from agentkv.vllm_plugin.jobs import StepJobs
from agentkv.vllm_plugin.scheduler import SchedulerSide
from agentkv.vllm_plugin.store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, ExportStore
from agentkv.vllm_plugin.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AgentKVConnector", "AgentKVMetadata"]

logger = init_logger("vllm.agentkv.connector")  # under vLLM's logger, so its handlers print it


class AgentKVMetadata(KVConnectorMetadata):
    """The step's jobs, from the scheduler half to the worker half."""

    def __init__(self, jobs: StepJobs) -> None:
        self.jobs = jobs


class AgentKVConnector(KVConnectorBase_V1):
    """Exports prompt KV in a layout-independent form and loads exports, mapped across models when asked."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        if "store" not in extra:
            raise ValueError("AgentKVConnector needs kv_connector_extra_config.store (a folder for exports)")
        store = ExportStore(extra["store"], max_bytes=int(extra.get("max_bytes", DEFAULT_MAX_BYTES)),
                            max_age_s=float(extra.get("max_age_s", DEFAULT_MAX_AGE_S)))
        mappers = {str(name): str(path) for name, path in dict(extra.get("mappers") or {}).items()}
        self._block_size = vllm_config.cache_config.block_size
        self._failed_blocks: set[int] = set()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning("AgentKVConnector: kv_load_failure_policy=%r fails a request whose load fails; "
                               "'recompute' re-prefills it instead", transfer.kv_load_failure_policy)
            self._scheduler = SchedulerSide(store, model_signature(vllm_config), model=_served_name(vllm_config),
                                            mappers=mapper_entries(mappers), block_size=self._block_size)
        else:
            self._worker = WorkerSide(store, mappers=mappers, block_size=self._block_size)
        logger.info("AgentKVConnector (%s): store %s, mappers %s", role.name.lower(), store.root, sorted(mappers))

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        layers = get_layers_from_vllm_config(self._vllm_config, Attention, list(kv_caches))
        names = sorted(layers, key=extract_layer_index)
        self._worker.register([(kv_caches[name], _writer(layers[name])) for name in names])
        first = kv_caches[names[0]]
        logger.info("AgentKVConnector: %d layers, cache %s %s", len(names), tuple(first.shape), first.dtype)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._failed_blocks |= self._worker.load(self._jobs().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.export(self._jobs().exports)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _jobs(self) -> StepJobs:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, AgentKVMetadata)
        return metadata.jobs

    # ----------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None and self._kv_cache_manager is not None
        manager = self._kv_cache_manager
        return AgentKVMetadata(self._scheduler.build(scheduler_output, lambda req_id: manager.get_block_ids(req_id)[0]))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.outcome(set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.finished(request)


def model_signature(vllm_config: VllmConfig) -> ModelSignature:
    """The served model's KV signature; its id is the model path vLLM was started with."""
    model_config = vllm_config.model_config
    return ModelSignature.from_config(model_config.hf_config, model_id=str(model_config.model))


def mapper_entries(paths: dict[str, str]) -> dict[str, MapperEntry]:
    """Each configured mapper's identity and signatures, read from its manifest (no tensors)."""
    from agentkv.handoff.manifest import signature_pair
    from agentkv.handoff.registry import read_manifest
    from agentkv.wire.kv_transfer import mapper_digest

    return {name: MapperEntry(path, mapper_digest(path), signature_pair(read_manifest(path), path))
            for name, path in paths.items()}


def _served_name(vllm_config: VllmConfig) -> str:
    served = vllm_config.model_config.served_model_name
    return str(served[0] if isinstance(served, (list, tuple)) else served)


def _writer(layer: Any) -> Any:
    """The attention backend's own cache writer for ``layer``: (kv_cache, keys, values, slots) -> None."""

    def write(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)

    return write
