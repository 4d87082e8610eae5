"""The connector's scheduler half: which requests load how many tokens, and which export when their prefill ends.

It runs in vLLM's engine process and sees requests, never tensors; what the worker half must do reaches it
only through the :class:`~agentkv.vllm_plugin.jobs.StepJobs` built each step. vLLM objects are read by attribute
(``request.prompt_token_ids``, ``scheduler_output.scheduled_new_reqs`` ...), so nothing here imports vLLM.

    side = SchedulerSide(store, signature, model="fast", mappers={}, block_size=128)
    side.matched_tokens(request, num_computed)      # get_num_new_matched_tokens
    side.allocated(request, num_external)           # update_state_after_alloc
    jobs = side.build(scheduler_output, block_ids_of)
    side.finished(request)                          # -> kv_transfer_params of the answer
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

from agentkv.handoff.signature import ModelSignature
from agentkv.vllm_plugin.decide import ImportInputs, ImportPlan, MapperEntry, plan_import
from agentkv.vllm_plugin.jobs import ExportJob, LoadJob, StepJobs
from agentkv.wire.kv_transfer import KEY, TransferRequest, parse_request, salt_digest
from agentkv.vllm_plugin.store import ExportManifest, ExportStore, export_id

__all__ = ["SchedulerSide"]

log = logging.getLogger("vllm.agentkv.scheduler")  # a child of vLLM's logger: its handlers print it


class SchedulerSide:
    """Per-request plans between vLLM's scheduler calls; cleared when a request finishes."""

    def __init__(self, store: ExportStore, signature: ModelSignature, *, model: str,
                 mappers: Mapping[str, MapperEntry], block_size: int, clock: Callable[[], float] = time.time) -> None:
        self.store, self.signature, self.model = store, signature, model
        self.mappers, self.block_size, self.clock = dict(mappers), block_size, clock
        self._plans: dict[str, ImportPlan] = {}
        self._loading: dict[str, tuple[ImportPlan, int]] = {}
        self._exports: dict[str, ExportManifest] = {}
        self._exported: dict[str, ExportManifest] = {}
        self._imports: dict[str, tuple[str, int, str]] = {}  # req_id -> (export id, tokens loaded, reason)
        self._in_flight: dict[str, LoadJob] = {}

    def matched_tokens(self, request: Any, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` this request can load (0 when it asks nothing or cannot)."""
        ask = parse_request(request.kv_transfer_params)
        if ask is None:
            return 0
        if ask.export:
            self._exports.setdefault(request.request_id, self._export_manifest(request))
        if not ask.wants_import:
            return 0
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = self._plans[request.request_id] = self._plan(request, ask)
            self._imports[request.request_id] = (ask.import_id or "", 0, plan.reason)
        return max(0, plan.tokens - num_computed)

    def _plan(self, request: Any, ask: TransferRequest) -> ImportPlan:
        assert ask.import_id is not None
        inputs = ImportInputs(ask, self.store.lookup(ask.import_id), list(request.prompt_token_ids or ()),
                              request.cache_salt, self.signature, self.mappers, self.block_size)
        plan = plan_import(inputs)
        log.info("agentkv import %s: %s", ask.import_id[:12], plan.reason)
        return plan

    def _export_manifest(self, request: Any) -> ExportManifest:
        tokens = tuple(int(t) for t in request.prompt_token_ids or ())
        salt = salt_digest(request.cache_salt)
        signature = self.signature.to_dict()
        return ExportManifest(export_id(signature, salt, tokens), self.model, signature, salt, tokens,
                              self.signature.num_layers, "", self.clock())

    def allocated(self, request: Any, num_external: int) -> None:
        """vLLM allocated blocks: remember a load of ``num_external`` tokens for this step's jobs."""
        plan = self._plans.get(request.request_id)
        if num_external > 0 and plan is not None:
            self._loading[request.request_id] = (plan, num_external)

    def build(self, scheduler_output: Any, block_ids_of: Callable[[str], Sequence[int]]) -> StepJobs:
        """This step's jobs: loads for newly scheduled requests, exports for requests whose prefill ends now."""
        jobs = StepJobs()
        for new in scheduler_output.scheduled_new_reqs:
            loading = self._loading.pop(new.req_id, None)
            if loading is not None:
                job = self._load_job(new, *loading)
                jobs.loads.append(job)
                self._in_flight[job.req_id] = job
                self._imports[job.req_id] = (job.export_id, job.end - job.start, self._imports[job.req_id][2])
        for req_id, computed in _scheduled(scheduler_output):
            manifest = self._exports.get(req_id)
            if manifest is not None and computed + scheduler_output.num_scheduled_tokens[req_id] >= manifest.tokens:
                jobs.exports.append(ExportJob(req_id, manifest, tuple(block_ids_of(req_id))))
                self._exported[req_id] = self._exports.pop(req_id)
        return jobs

    def _load_job(self, new: Any, plan: ImportPlan, num_external: int) -> LoadJob:
        self._plans.pop(new.req_id, None)  # planned again if preempted and rescheduled (the export is gone by then)
        end = int(new.num_computed_tokens)
        assert plan.export_id is not None
        return LoadJob(new.req_id, plan.export_id, plan.mapper, end - num_external, end, tuple(new.block_ids[0]))

    def outcome(self, invalid_block_ids: set[int]) -> None:
        """The worker's report of this step's loads: a load that touched an invalid block loaded nothing."""
        for req_id, job in list(self._in_flight.items()):
            del self._in_flight[req_id]
            if invalid_block_ids & job.touched_blocks(self.block_size):
                self._imports[req_id] = (job.export_id, 0, "the load failed; vLLM recomputed the tokens")

    def finished(self, request: Any) -> dict[str, Any] | None:
        """Forget the request; what it exported or imported goes back in the answer's ``kv_transfer_params``."""
        req_id = request.request_id
        for table in (self._plans, self._loading, self._exports, self._in_flight):
            table.pop(req_id, None)
        body: dict[str, Any] = {}
        manifest = self._exported.pop(req_id, None)
        if manifest is not None:
            body.update(export_id=manifest.export_id, tokens=manifest.tokens)
        imported = self._imports.pop(req_id, None)
        if imported is not None:
            body.update(imported=imported[0], tokens=imported[1], reason=imported[2])
        return {KEY: body} if body else None


def _scheduled(scheduler_output: Any) -> list[tuple[str, int]]:
    """``(request id, tokens computed before this step)`` of every request scheduled this step."""
    rows = [(new.req_id, int(new.num_computed_tokens)) for new in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    rows += [(req_id, int(n)) for req_id, n in zip(cached.req_ids, cached.num_computed_tokens)]
    return rows
