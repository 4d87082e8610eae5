"""The vLLM connector's parts without vLLM: wire format, export store, import decisions, the paged layout read back
through a writer, and the scheduler and worker halves driven with stand-ins for vLLM's objects."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from agentkv.handoff.learned import LearnedMapper
from agentkv.handoff.mapping import MapGeometry
from agentkv.handoff.rope import RopeTable
from agentkv.handoff.signature import ModelSignature, SignaturePair
from agentkv.handoff.offline.testing import torch_threads
from agentkv.vllm_plugin import (
    connector_config, export_params, export_result, handoff_salt, import_params, mapper_digest, parse_request,
    salt_digest,
)
from agentkv.vllm_plugin.decide import ImportInputs, MapperEntry, plan_import
from agentkv.vllm_plugin.jobs import LoadJob
from agentkv.vllm_plugin.metrics import prompt_tokens_by_source
from agentkv.wire.kv_transfer import import_result
from agentkv.vllm_plugin.paged import PagedLayout
from agentkv.vllm_plugin.scheduler import SchedulerSide
from agentkv.vllm_plugin.store import ExportError, ExportManifest, ExportStore, Lookup, evictions, export_id
from agentkv.vllm_plugin.worker import WorkerSide

HEADS, BLOCK, DIM, LAYERS = 2, 4, 8, 2
FAST = ModelSignature(LAYERS, HEADS, DIM, 1e6, (("rope_type", "default"),), "/m/fast")
SLOW = ModelSignature(3, HEADS, DIM, 1e6, (("rope_type", "default"),), "/m/slow")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes run fastest single-threaded."""
    with torch_threads(1):
        yield


# ----------------------------------------------------------------- a stand-in for the CPU backend's writer


def transposing_writer(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Like vLLM's float32 CPU writer: per block and head, keys stored [head_dim, block] and values [block, head_dim]."""
    blocks, heads, size, width = cache.shape
    dim = width // 2
    view = cache.view(blocks, heads, 2 * size * dim)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, size)
        for head in range(heads):
            view[block, head, torch.arange(dim) * size + offset] = keys[token, head]
            view[block, head, size * dim + offset * dim + torch.arange(dim)] = values[token, head]


def new_cache(blocks: int = 6) -> torch.Tensor:
    return torch.zeros(blocks, HEADS, BLOCK, 2 * DIM)


def layout() -> PagedLayout:
    return PagedLayout.probe(transposing_writer, kv_heads=HEADS, block_size=BLOCK, head_dim=DIM, dtype=torch.float32)


def test_layout_derived_from_the_writer_reads_back_what_it_wrote():
    """Tokens written through a transposing writer into scattered blocks read back exactly, in prompt order."""
    cache, blocks = new_cache(), [4, 1, 3]
    keys, values = torch.randn(10, HEADS, DIM), torch.randn(10, HEADS, DIM)
    paged = layout()
    paged.write(transposing_writer, cache, blocks, 0, keys[:6], values[:6])
    paged.write(transposing_writer, cache, blocks, 6, keys[6:], values[6:])
    got_keys, got_values = paged.read(cache, blocks, 10)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layout_probe_is_exact_in_half_precision(dtype):
    """The probe's numbers are split into digits small enough to be exact in 16-bit caches."""
    paged = PagedLayout.probe(transposing_writer, kv_heads=HEADS, block_size=BLOCK, head_dim=DIM, dtype=dtype)
    assert torch.equal(paged.key_index, layout().key_index) and torch.equal(paged.value_index, layout().value_index)


def test_a_writer_that_drops_elements_is_refused():
    """A writer that fills less than a whole block cannot be inverted, and says so."""
    def lossy(cache, keys, values, slots):
        transposing_writer(cache, keys, values, slots)
        cache.view(-1)[0] = 0.0

    with pytest.raises(ValueError, match="filled"):
        PagedLayout.probe(lossy, kv_heads=HEADS, block_size=BLOCK, head_dim=DIM, dtype=torch.float32)


# ----------------------------------------------------------------- wire format


def test_transfer_params_round_trip_and_refuse_paths():
    """Requests parse to what they asked; an id that is not a hex digest (a path, say) is no import at all."""
    assert parse_request(export_params()).export
    ask = parse_request(import_params("ab" * 16, mapper="fast"))
    assert ask is not None and (ask.import_id, ask.mapper) == ("ab" * 16, "fast")
    assert parse_request(import_params("../../etc/passwd")) is None
    assert parse_request({"other": {}}) is None and parse_request(None) is None
    assert export_result({"agentkv": {"export_id": "cd" * 16, "tokens": 7}}) == ("cd" * 16, 7)
    assert export_result(None) is None


def test_handoff_salt_differs_per_tenant_and_mapper_and_from_ordinary_salts():
    """The handoff salt depends on the tenant's salt and the mapper, and is never the tenant's salt itself."""
    salts = {handoff_salt(s, m) for s in ("t1", "t2", None) for m in ("m1", "m2")}
    assert len(salts) == 6 and not salts & {"t1", "t2"}
    assert salt_digest(None) != salt_digest("")


def test_mapper_digest_changes_with_the_weights(tmp_path):
    """A mapper's identity is its files' content: new weights, new digest (and so a new handoff salt)."""
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "weights.safetensors").write_bytes(b"a")
    first = mapper_digest(tmp_path)
    (tmp_path / "weights.safetensors").write_bytes(b"b")
    assert mapper_digest(tmp_path) != first


def test_connector_config_recomputes_failed_loads():
    """The config helper names the connector's module and asks vLLM to re-prefill a failed load."""
    config = connector_config("/s", mappers={"fast": "/m"})
    assert config["kv_connector_module_path"] == "agentkv.vllm_plugin.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"store": "/s", "mappers": {"fast": "/m"}}


def test_prompt_tokens_by_source_reads_vllms_counter():
    """The external_kv_transfer count is read from vLLM's Prometheus text, per model when asked."""
    text = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="slow",source="external_kv_transfer"} 256.0\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="fast",source="external_kv_transfer"} 128.0\n')
    assert prompt_tokens_by_source(text)["external_kv_transfer"] == 384
    assert prompt_tokens_by_source(text, "slow") == {"external_kv_transfer": 256}


def test_importing_agentkv_vllm_imports_neither_vllm_nor_torch():
    """``agentkv.vllm_plugin`` (what the Session uses) stays free of vLLM and torch; only its connector module needs them."""
    code = "import sys, agentkv, agentkv.vllm_plugin; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


# ----------------------------------------------------------------- the store


def manifest_for(tokens: list[int], salt: str | None = "s", signature: ModelSignature = FAST,
                 created_at: float = 0.0) -> ExportManifest:
    sig, digest = signature.to_dict(), salt_digest(salt)
    return ExportManifest(export_id(sig, digest, tokens), "fast", sig, digest, tuple(tokens), signature.num_layers,
                          "float32", created_at)


def written(store: ExportStore, tokens: list[int], **kw) -> tuple[ExportManifest, list[torch.Tensor]]:
    manifest = manifest_for(tokens, **kw)
    keys = [torch.randn(len(tokens), HEADS, DIM) for _ in range(manifest.num_layers)]
    return store.write(manifest, keys, [k * 2 for k in keys], torch.arange(len(tokens))), keys


def test_store_round_trip_and_names_files_by_digest(tmp_path):
    """An export reads back as written, window by window, from files named only by its digest."""
    store = ExportStore(tmp_path, clock=lambda: 10.0)
    manifest, keys = written(store, list(range(9)), created_at=10.0)
    found = store.lookup(manifest.export_id)
    assert found.manifest is not None and found.manifest.sha256 == manifest.sha256
    got_keys, got_values, positions = store.load(found.manifest, 2, 7)
    assert torch.equal(got_keys[1], keys[1][2:7]) and torch.equal(got_values[0], 2 * keys[0][2:7])
    assert positions.tolist() == [2, 3, 4, 5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{manifest.export_id}.json",
                                                         f"{manifest.export_id}.safetensors"]


def test_store_refuses_altered_tensors(tmp_path):
    """Tensors changed after their manifest was written fail the sha256 check."""
    store = ExportStore(tmp_path, clock=lambda: 0.0)
    manifest, _ = written(store, list(range(9)))
    path = tmp_path / f"{manifest.export_id}.safetensors"
    path.write_bytes(path.read_bytes()[:-8] + bytes(8))
    with pytest.raises(ExportError, match="sha256"):
        store.load(manifest, 0, 9)


def test_store_drops_stale_exports(tmp_path):
    """An export older than max_age_s is reported stale and deleted."""
    now = [0.0]
    store = ExportStore(tmp_path, max_age_s=60.0, clock=lambda: now[0])
    manifest, _ = written(store, list(range(9)))
    now[0] = 61.0
    assert "stale" in store.lookup(manifest.export_id).reason
    assert store.entries() == []


def test_store_evicts_least_recently_used_past_its_byte_bound():
    """Eviction removes the least recently used exports until the rest fit the bound."""
    entries = [("a", 100, 3.0), ("b", 100, 1.0), ("c", 100, 2.0)]
    assert evictions(entries, 300) == [] and evictions(entries, 150) == ["b", "c"]


def test_store_bounded_in_bytes(tmp_path):
    """Writing past the byte bound deletes the oldest exports."""
    store = ExportStore(tmp_path, max_bytes=1, clock=lambda: 0.0)
    manifest, _ = written(store, list(range(9)))
    assert store.lookup(manifest.export_id).manifest is None


# ----------------------------------------------------------------- import decisions


def entry(digest: str = "m" * 8, pair: SignaturePair = SignaturePair(FAST, SLOW)) -> MapperEntry:
    return MapperEntry("/mappers/f2s", digest, pair)


def decide(manifest: ExportManifest | None, prompt: list[int], salt: str | None, *, mapper: str | None = None,
           signature: ModelSignature = FAST) -> tuple[int, str]:
    ask = parse_request(import_params("ab" * 16, mapper=mapper))
    assert ask is not None
    plan = plan_import(ImportInputs(ask, Lookup(manifest, "found" if manifest else "no such export"), prompt, salt,
                                    signature, {"fast": entry()}, block_size=BLOCK))
    return plan.tokens, plan.reason


def test_exact_import_loads_block_aligned_prefix_leaving_the_last_token():
    """A same-model import loads whole blocks of the shared prefix, never the prompt's last token."""
    manifest = manifest_for(list(range(12)))
    assert decide(manifest, list(range(12)), "s")[0] == 8  # 11 loadable -> two blocks of 4
    assert decide(manifest, list(range(9)) + [99, 98], "s")[0] == 8
    assert decide(manifest, [5, 6, 7, 8, 9], "s") == (0, "the export shares 0 prompt tokens: less than a "
                                                          "4-token block")


def test_exact_import_needs_the_exporters_salt_and_model():
    """Another salt, or an export of another model named without a mapper, loads nothing."""
    manifest = manifest_for(list(range(12)))
    assert decide(manifest, list(range(12)), "other") == (0, "the request's cache_salt is not the exporter's")
    tokens, reason = decide(manifest, list(range(12)), "s", signature=SLOW)
    assert tokens == 0 and "another model" in reason


def test_mapped_import_loads_only_under_its_handoff_salt():
    """A mapped import needs the handoff salt of the exporter's salt and this mapper: the ordinary salt is refused."""
    manifest, prompt = manifest_for(list(range(12))), list(range(12))
    assert decide(manifest, prompt, handoff_salt("s", "m" * 8), mapper="fast", signature=SLOW)[0] == 8
    assert decide(manifest, prompt, "s", mapper="fast", signature=SLOW)[0] == 0
    assert decide(manifest, prompt, handoff_salt("t", "m" * 8), mapper="fast", signature=SLOW)[0] == 0
    assert decide(manifest, prompt, handoff_salt("s", "other"), mapper="fast", signature=SLOW)[0] == 0


def test_mapped_import_checks_both_sides_of_the_mapper():
    """An unknown mapper, an export the mapper does not read, or a model it does not write: no load."""
    prompt, salt = list(range(12)), handoff_salt("s", "m" * 8)
    assert "no mapper" in decide(manifest_for(prompt), prompt, salt, mapper="nope", signature=SLOW)[1]
    assert "does not read" in decide(manifest_for(prompt, signature=SLOW), prompt, salt, mapper="fast",
                                     signature=SLOW)[1]
    assert "does not write" in decide(manifest_for(prompt), prompt, salt, mapper="fast", signature=FAST)[1]


def test_missing_export_is_no_load():
    """No export: zero tokens, with the store's reason."""
    assert decide(None, list(range(12)), "s") == (0, "export unusable: no such export")


# ----------------------------------------------------------------- the two halves


def request(req_id: str, tokens: list[int], salt: str | None, params: dict | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, cache_salt=salt, kv_transfer_params=params)


def step(new: list[tuple[str, int, list[int]]], scheduled: dict[str, int],
         cached: list[tuple[str, int]] = ()) -> SimpleNamespace:
    """A scheduler output: new requests (id, computed, blocks), tokens scheduled, cached requests (id, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(b,)) for r, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled)


def test_scheduler_exports_when_the_prompt_is_fully_computed(tmp_path):
    """A chunked prefill exports in the step that computes its last prompt token, and the answer names the export."""
    side = SchedulerSide(ExportStore(tmp_path), FAST, model="fast", mappers={}, block_size=BLOCK)
    asked = request("r", list(range(10)), "s", export_params())
    assert side.matched_tokens(asked, 0) == 0
    assert side.build(step([("r", 0, [3, 1, 2])], {"r": 6}), lambda _: [3, 1, 2]).exports == []
    jobs = side.build(step([], {"r": 4}, cached=[("r", 6)]), lambda _: [3, 1, 2])
    assert [(j.req_id, j.manifest.tokens, j.block_ids) for j in jobs.exports] == [("r", 10, (3, 1, 2))]
    assert side.finished(asked) == {"agentkv": {"export_id": jobs.exports[0].manifest.export_id, "tokens": 10}}


def test_scheduler_loads_the_range_vllm_allocated(tmp_path):
    """A planned import becomes a load of the tokens past the local hit, into the request's blocks."""
    store = ExportStore(tmp_path, clock=lambda: 0.0)
    manifest, _ = written(store, list(range(12)))
    side = SchedulerSide(store, FAST, model="fast", mappers={}, block_size=BLOCK)
    asked = request("r", list(range(12)), "s", import_params(manifest.export_id))
    assert side.matched_tokens(asked, 4) == 4  # 8 loadable, 4 already local
    side.allocated(asked, 4)
    jobs = side.build(step([("r", 8, [5, 6, 7])], {"r": 4}), lambda _: [])
    assert jobs.loads == [LoadJob("r", manifest.export_id, None, 4, 8, (5, 6, 7))]
    side.outcome(set())
    assert import_result(side.finished(asked)) == (4, "exact: 8 of 11 shared tokens (block-aligned)")


def test_scheduler_reports_a_failed_load_as_no_tokens(tmp_path):
    """A load the worker reported failed (an invalid block of its range) is answered as 0 tokens loaded."""
    store = ExportStore(tmp_path, clock=lambda: 0.0)
    manifest, _ = written(store, list(range(12)))
    side = SchedulerSide(store, FAST, model="fast", mappers={}, block_size=BLOCK)
    asked = request("r", list(range(12)), "s", import_params(manifest.export_id))
    side.allocated(asked, side.matched_tokens(asked, 0))
    side.build(step([("r", 8, [5, 6, 7])], {"r": 4}), lambda _: [])
    side.outcome({6})
    assert import_result(side.finished(asked))[0] == 0


def test_scheduler_answers_a_refused_import_with_its_reason(tmp_path):
    """An import that cannot load says why in the answer, with 0 tokens."""
    side = SchedulerSide(ExportStore(tmp_path), FAST, model="fast", mappers={}, block_size=BLOCK)
    asked = request("r", list(range(12)), "s", import_params("ab" * 16))
    assert side.matched_tokens(asked, 0) == 0
    assert import_result(side.finished(asked)) == (0, "export unusable: no such export")


def identity_ridge(pair: SignaturePair) -> LearnedMapper:
    """A ridge map whose weights copy each layer (target layer t reads source layer t % 2), RoPE stripped."""
    from agentkv.handoff.ridge import RidgeMapper

    width = HEADS * DIM
    rope = RopeTable(1.0 / (1e6 ** (torch.arange(0, DIM, 2, dtype=torch.float) / DIM)))
    selected = tuple((t % pair.source.num_layers,) for t in range(pair.target.num_layers))
    params = {f"{kind}.{t}.{name}": (torch.eye(width) if name == "weight" else torch.zeros(width))
              for kind in ("keys", "values") for t in range(pair.target.num_layers) for name in ("weight", "bias")}
    return RidgeMapper(MapGeometry(pair, selected, rope, rope), params, {"evaluation": {"attention_cosine": 1.0}})


def worker(store: ExportStore, layers: int, mappers: dict[str, str] | None = None) -> WorkerSide:
    side = WorkerSide(store, mappers=mappers or {}, block_size=BLOCK)
    side.register([(new_cache(), transposing_writer) for _ in range(layers)])
    return side


def export_from(fast: WorkerSide, tmp_store: ExportStore, tokens: list[int], blocks: list[int]) -> ExportManifest:
    from agentkv.vllm_plugin.jobs import ExportJob

    keys = torch.randn(len(tokens), HEADS, DIM)
    for cache, writer in fast.layers:
        fast.layout.write(writer, cache, blocks, 0, keys, keys + 1)
    manifest = manifest_for(tokens)
    fast.export([ExportJob("r", manifest, tuple(blocks))])
    found = tmp_store.lookup(manifest.export_id).manifest
    assert found is not None
    return found


def test_worker_export_then_identity_load_copies_the_kv_and_deletes_the_export(tmp_path):
    """A load writes the exported tokens into the importer's blocks exactly, then the export is deleted."""
    store = ExportStore(tmp_path, clock=lambda: 0.0)
    fast, other = worker(store, LAYERS), worker(store, LAYERS)
    manifest = export_from(fast, store, list(range(10)), [2, 0, 5])
    assert other.load([LoadJob("q", manifest.export_id, None, 4, 8, (1, 3, 4))]) == set()
    for (source, _), (target, _) in zip(fast.layers, other.layers):
        assert torch.equal(other.layout.read(target, [1, 3, 4], 8)[0][4:], fast.layout.read(source, [2, 0, 5], 8)[0][4:])
        assert not other.layout.read(target, [1, 3, 4], 4)[0].any()  # tokens below start were not written
    assert store.lookup(manifest.export_id).manifest is None


def test_worker_mapped_load_strips_and_reapplies_rope(tmp_path):
    """Through a copy-weight ridge mapper, mapped keys equal the exported ones: RoPE stripped, then reapplied at the
    same positions; a 3-layer target is filled from a 2-layer source."""
    from agentkv.handoff.protocol import KVMapper

    store = ExportStore(tmp_path, clock=lambda: 0.0)
    mapper: KVMapper = identity_ridge(SignaturePair(FAST, SLOW))
    mapper.save(tmp_path / "mapper")
    fast, slow = worker(store, LAYERS), worker(store, 3, {"fast": str(tmp_path / "mapper")})
    manifest = export_from(fast, store, list(range(10)), [2, 0, 5])
    assert slow.load([LoadJob("q", manifest.export_id, "fast", 0, 8, (1, 3, 4))]) == set()
    exported = fast.layout.read(fast.layers[0][0], [2, 0, 5], 8)
    for cache, _ in slow.layers:
        keys, values = slow.layout.read(cache, [1, 3, 4], 8)
        assert torch.allclose(keys, exported[0], atol=1e-5) and torch.allclose(values, exported[1], atol=1e-5)


def test_worker_reports_the_blocks_of_a_failed_load(tmp_path):
    """A load whose export is gone fails quietly and names the blocks it would have written."""
    side = worker(ExportStore(tmp_path), LAYERS)
    assert side.load([LoadJob("q", "ab" * 16, None, 4, 9, (1, 3, 4, 5))]) == {3, 4}
