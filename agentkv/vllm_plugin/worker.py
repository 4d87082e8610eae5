"""The connector's worker half: KV out of the paged cache into the store, and from the store (mapped) back in.

It runs in vLLM's worker process, next to the model and its caches, so mapping happens on the server's own
device and the client never moves tensors. It acts only on the :class:`~agentkv.vllm_plugin.jobs.StepJobs` the
scheduler half built, and on the caches and attention layers vLLM registered.

    side = WorkerSide(store, mappers={"fast": "/mappers/fast-slow"}, block_size=128)
    side.register(layers)                 # [(kv_cache, writer)] in model layer order
    failed = side.load(jobs.loads)        # before the forward: block ids whose load failed
    side.export(jobs.exports)             # after the forward: write each finished prompt's KV
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.signature import ModelSignature
from agentkv.vllm_plugin.jobs import ExportJob, LoadJob
from agentkv.vllm_plugin.paged import PagedLayout, Writer
from agentkv.vllm_plugin.store import ExportError, ExportStore

__all__ = ["WorkerSide"]

log = logging.getLogger("vllm.agentkv.worker")


class WorkerSide:
    """The registered caches, the layout derived from their writer, and the mappers (loaded on first use)."""

    def __init__(self, store: ExportStore, *, mappers: Mapping[str, str], block_size: int) -> None:
        self.store, self.mapper_paths, self.block_size = store, dict(mappers), block_size
        self.layers: list[tuple[torch.Tensor, Writer]] = []
        self._layout: PagedLayout | None = None
        self._mappers: dict[str, Any] = {}

    def register(self, layers: Sequence[tuple[torch.Tensor, Writer]]) -> None:
        """Every attention layer's cache ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` and writer, in order.

        The mappers are loaded now, not on a request's path; so is the layout when the writer can already run."""
        self.layers = list(layers)
        for name in self.mapper_paths:
            try:
                self._mapper(name)
            except Exception as error:  # its imports will fail and be recomputed; the server still serves
                log.warning("agentkv mapper %r unusable: %s: %s", name, type(error).__name__, error)
        try:
            self._layout = self.layout
        except Exception as error:  # the writer needs state vLLM sets up later: probed on first use
            log.info("agentkv layout probe deferred: %s", type(error).__name__)

    @property
    def layout(self) -> PagedLayout:
        """The block layout, probed through the first layer's writer on first use (the writer needs vLLM's
        attention metadata builders to have run, so not at registration)."""
        if self._layout is None:
            cache, writer = self.layers[0]
            _, heads, block_size, width = cache.shape
            self._layout = PagedLayout.probe(writer, kv_heads=heads, block_size=block_size, head_dim=width // 2,
                                             dtype=cache.dtype, device=cache.device)
        return self._layout

    # ----------------------------------------------------------------- exports

    def export(self, jobs: Sequence[ExportJob]) -> None:
        """Write each job's prompt KV; a failure is logged and the export is simply absent."""
        for job in jobs:
            try:
                self._export(job)
            except Exception as error:  # an export never fails the request it rides on
                log.warning("agentkv export %s failed: %s: %s", job.manifest.export_id[:12], type(error).__name__,
                            error)

    def _export(self, job: ExportJob) -> None:
        started = time.perf_counter()
        n = job.manifest.tokens
        keys, values = [], []
        for cache, _ in self.layers:
            k, v = self.layout.read(cache, job.block_ids, n)  # [n, kv_heads, head_dim] each
            keys.append(k)
            values.append(v)
        manifest = replace(job.manifest, dtype=str(self.layers[0][0].dtype).removeprefix("torch."))
        written = self.store.write(manifest, keys, values, torch.arange(n))
        log.info("agentkv export %s: %d tokens, %d bytes in %.1f ms", written.export_id[:12], n, written.nbytes,
                 (time.perf_counter() - started) * 1e3)

    # ----------------------------------------------------------------- loads

    def load(self, jobs: Sequence[LoadJob]) -> set[int]:
        """Run each load; the block ids of those that failed (vLLM then recomputes them, under ``recompute``)."""
        failed: set[int] = set()
        for job in jobs:
            try:
                self._load(job)
            except Exception as error:  # a failed load is a re-prefill, never an error to the caller
                log.warning("agentkv import %s failed, recomputing: %s: %s", job.export_id[:12],
                            type(error).__name__, error)
                failed |= job.touched_blocks(self.block_size)
        return failed

    def _load(self, job: LoadJob) -> None:
        started = time.perf_counter()
        found = self.store.lookup(job.export_id)
        if found.manifest is None:
            raise ExportError(found.reason)
        cache, _ = self.layers[0]
        keys, values, positions = self.store.load(found.manifest, job.start, job.end, cache.device)
        read_ms = (time.perf_counter() - started) * 1e3
        if job.mapper is not None:
            keys, values = self._mapped(job.mapper, found.manifest.signature, keys, values, positions)
        if len(keys) != len(self.layers):
            raise ExportError(f"{len(keys)} layers of KV for a model of {len(self.layers)}")
        map_ms = (time.perf_counter() - started) * 1e3 - read_ms
        for (cache, writer), k, v in zip(self.layers, keys, values):
            self.layout.write(writer, cache, job.block_ids, job.start, k, v)
        self.store.delete(job.export_id)
        log.info("agentkv import %s: tokens %d..%d%s, read %.1f ms, map %.1f ms, total %.1f ms", job.export_id[:12],
                 job.start, job.end, f" mapped by {job.mapper!r}" if job.mapper else "", read_ms, map_ms,
                 (time.perf_counter() - started) * 1e3)

    def _mapped(self, name: str, signature: dict[str, Any], keys: list[torch.Tensor], values: list[torch.Tensor],
                positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Map exported KV with mapper ``name``: source RoPE stripped, this model's applied at the same positions.

        keys/values per source layer: [tokens, kv_heads, head_dim] -> per target layer, same shape.
        """
        mapper = self._mapper(name)
        source = KVCache.from_layers([k.permute(1, 0, 2).unsqueeze(0).float() for k in keys],  # (T,H,D) -> (1,H,T,D)
                                     [v.permute(1, 0, 2).unsqueeze(0).float() for v in values],
                                     ModelSignature.from_dict(signature), positions.unsqueeze(0))
        mapped = mapper.map(source, target_positions=positions.unsqueeze(0))
        return ([k[0].permute(1, 0, 2) for k in mapped.keys],  # (1,H,T,D) -> (T,H,D)
                [v[0].permute(1, 0, 2) for v in mapped.values])

    def _mapper(self, name: str) -> Any:
        if name not in self._mappers:
            from agentkv.handoff.registry import load_mapper

            self._mappers[name] = load_mapper(self.mapper_paths[name])
        return self._mappers[name]
