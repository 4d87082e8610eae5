"""What the connector's scheduler side tells its worker side each step: the only thing the two halves share.

Plain picklable dataclasses (vLLM ships the step's metadata from the engine process to the worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentkv.vllm_plugin.store import ExportManifest

__all__ = ["ExportJob", "LoadJob", "StepJobs"]


@dataclass(frozen=True)
class ExportJob:
    """Write the first ``manifest.tokens`` tokens' KV of request ``req_id`` (in ``block_ids``) as ``manifest``."""

    req_id: str
    manifest: ExportManifest
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadJob:
    """Load export ``export_id``'s tokens ``[start, end)`` into request ``req_id``'s ``block_ids``, mapped by
    the mapper configured under ``mapper`` (None: the export is this model's own KV)."""

    req_id: str
    export_id: str
    mapper: str | None
    start: int
    end: int
    block_ids: tuple[int, ...]

    def touched_blocks(self, block_size: int) -> set[int]:
        """The block ids this load writes into (what a failed load reports as invalid)."""
        first, last = self.start // block_size, -(-self.end // block_size)
        return set(self.block_ids[first:last])


@dataclass
class StepJobs:
    """One step's loads (run before the forward) and exports (run after it)."""

    loads: list[LoadJob] = field(default_factory=list)
    exports: list[ExportJob] = field(default_factory=list)
