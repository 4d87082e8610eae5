"""The client-side KV handoff as a plan and an executor: the plan is decided from plain data, each executor acts only
on it and returns what the escalated request must carry, and torch and file work goes out as an Offload effect."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from agentkv import Backend, Handoff
from agentkv._support.effects import Call, Offload, arun, run
from agentkv._support.jobs import BackgroundJobs
from agentkv.handoff.escalation_plan import EscalationPlan, plan_escalation
from agentkv.handoff.executors import Mappers, in_process, slow_cold
from agentkv.testing import FakeHttp
from agentkv.tokens import payload_from_request
from agentkv.vllm_plugin import handoff_salt, mapper_digest

EXPORT_ID = "cd" * 16
FAST = Backend("hosted_vllm/fast", api_base="http://127.0.0.1:9/v1", name="fast")
SLOW = Backend("hosted_vllm/slow", api_base="http://127.0.0.1:8/v1", name="slow")
SIGNATURE = {"num_layers": 2, "kv_heads": 2, "head_dim": 32, "rope_theta": 1e6, "rope_scaling": {"rope_type": "default"}}


def payload(text="hi"):
    return payload_from_request({"messages": [{"role": "user", "content": text}]})


def mapper_folder(tmp_path, cosine=0.99):
    folder = tmp_path / "mapper"
    folder.mkdir()
    manifest = {"backend": "ridge", "format_version": 1, "evaluation": {"attention_cosine": cosine},
                "signatures": {"source": SIGNATURE, "target": {**SIGNATURE, "num_layers": 4}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "weights.safetensors").write_bytes(b"weights")
    return folder


def exporting(exports):
    def handle(method, url, body):
        exports.append((method, url, body))
        return {"choices": [], "kv_transfer_params": {"agentkv": {"export_id": EXPORT_ID, "tokens": 16}}}

    return FakeHttp(handle)


def test_the_plan_is_a_pure_function_of_plain_data():
    """Replay, in-process engines and vLLM servers each get their plan; the vLLM plan names the export (what fast
    last served, to fast's URL, with the routing headers) and the mapper name slow knows, and hides the salt."""
    assert plan_escalation(FAST, SLOW, payload(), "salt", backend="replay").engine == "replay"
    embedded = plan_escalation(FAST, SLOW, payload(), "salt", backend="identity")
    assert (embedded.engine, embedded.fast_url, embedded.slow_url) == ("embedded", FAST.api_base, SLOW.api_base)
    vllm = plan_escalation(FAST, SLOW, payload("now"), "salt", backend="identity", via="vllm", previous=payload("then"),
                           headers={"X-Session-ID": "k"}, request={"messages": []}, export_timeout_s=5)
    assert vllm.engine == "vllm" and vllm.mapper_name == "fast" and vllm.prefix == payload("then")
    assert vllm.export.url == "http://127.0.0.1:9/v1/chat/completions" and vllm.export.timeout_s == 5
    assert vllm.export.body["messages"] == [{"role": "user", "content": "then"}]
    assert vllm.export.body["cache_salt"] == "salt" and vllm.export.headers == {"X-Session-ID": "k"}
    assert "salt" not in repr(vllm) and "then" not in repr(vllm)
    assert plan_escalation(FAST, SLOW, payload(), None, backend="identity", via="vllm") == \
        plan_escalation(FAST, SLOW, payload(), None, backend="identity", via="vllm")
    with pytest.raises(ValueError, match="engine"):
        EscalationPlan("carrier-pigeon", "identity")


def test_the_vllm_executor_returns_the_import_and_edits_nothing(tmp_path):
    """Over vLLM the executor exports on fast and returns the escalated request's kwargs naming the export under
    the handoff salt; the kwargs it was planned with are left as they were."""
    folder, exports, kwargs = mapper_folder(tmp_path), [], {"messages": [], "extra_body": {"top_k": 5}}
    handoff = Handoff("ridge", mapper=folder, via="vllm")
    plan = handoff.plan(FAST, SLOW, payload(), "salt", request=kwargs)
    outcome = run(handoff.execute(plan, http=exporting(exports)), BackgroundJobs())
    assert [(m, u) for m, u, _ in exports] == [("POST", "http://127.0.0.1:9/v1/chat/completions")]
    assert outcome.pending and not outcome.fallback and outcome.request.export == EXPORT_ID
    assert outcome.request.kwargs["extra_body"] == {"top_k": 5,
                                                    "kv_transfer_params": {"agentkv": {"import": EXPORT_ID,
                                                                                       "mapper": "fast"}}}
    assert outcome.request.cache_salt == handoff_salt("salt", mapper_digest(folder))
    assert kwargs == {"messages": [], "extra_body": {"top_k": 5}} and "salt" not in repr(outcome)


def test_a_raw_request_names_the_export_at_its_top_level():
    """A raw OpenAI body (the transport, the gateway) carries the import as a top-level field."""
    handoff = Handoff("identity", via="vllm")
    plan = handoff.plan(FAST, SLOW, payload(), "salt", request={"model": "slow"}, raw=True)
    outcome = run(handoff.execute(plan, http=exporting([])), BackgroundJobs())
    assert outcome.request.kwargs == {"model": "slow", "kv_transfer_params": {"agentkv": {"import": EXPORT_ID}}}
    assert outcome.request.cache_salt == "salt"


def test_under_the_async_driver_the_export_is_awaited_and_the_mapper_read_off_the_loop(tmp_path):
    """The vLLM executor's export goes through the seam's async method, and the mapper's files are read on a
    worker thread, never on the event loop's."""
    exports, threads = [], []
    http = exporting(exports)
    mappers = Mappers("ridge", mapper_folder(tmp_path))
    summary = mappers.summary

    def read():
        threads.append(threading.get_ident())
        return summary()

    mappers.summary = read
    plan = plan_escalation(FAST, SLOW, payload(), "salt", backend="ridge", via="vllm")

    async def main():
        from agentkv.handoff.executors import execute

        return threading.get_ident(), await arun(execute(plan, mappers, http=http), BackgroundJobs())

    loop_thread, outcome = asyncio.run(main())
    assert outcome.pending and threads and threads[0] != loop_thread
    assert [c.asynchronous for c in http.calls] == [True]


def test_the_in_process_executor_offloads_the_torch_work(monkeypatch):
    """With both engines served in this process, the map runs as one Offload (on a thread under the async
    driver); without them it falls back at once, with the reason."""
    import agentkv.embedded

    machine = in_process(plan_escalation(FAST, SLOW, payload(), None, backend="identity"), Mappers("identity"))
    with pytest.raises(StopIteration) as done:
        next(machine)
    assert done.value.value.fallback and "embedded engines" in done.value.value.reason
    monkeypatch.setattr(agentkv.embedded, "engine_at", lambda url: object() if url else None)
    machine = in_process(plan_escalation(FAST, SLOW, payload(), None, backend="identity"), Mappers("identity"))
    assert isinstance(next(machine), Offload)
    with pytest.raises(StopIteration) as done:  # what the offloaded work raised ends the machine as a replay
        machine.throw(RuntimeError("the map failed"))
    assert done.value.value.fallback and done.value.value.reason == "RuntimeError: the map failed"


class _Ledger:
    def __init__(self, held):
        self.held_now = held

    def block_size(self, backend):
        return 16

    def live(self, backend):
        return True


class _Counter:
    def token_ids(self, payload, *, add_generation_prompt=True):
        return list(range(64)), True

    async def _atoken_ids(self, payload, *, add_generation_prompt=True):
        return self.token_ids(payload, add_generation_prompt=add_generation_prompt)

    def ids(self, payload, *, add_generation_prompt=True):  # as TokenCounter.ids: the server's ids are a Call
        return (yield Call(self.token_ids, self._atoken_ids, (payload,), {"add_generation_prompt": add_generation_prompt}))


class _Residency:
    """The ledger view of slow that warm-ahead keeps (``agentkv.warm.aware.SlowResidency``'s surface)."""

    def __init__(self, held):
        self.counter, self.ledger, self.backend = _Counter(), _Ledger(held), SLOW

    def held(self, ids):
        return self.ledger.held_now


def test_slow_holding_the_warm_needs_no_handoff():
    """No warm: cold. A warm the ledger shows held: not cold (the count goes out as a Call). An evicted one: cold."""
    assert run(slow_cold(None, None), BackgroundJobs()) == "no warm-ahead reached slow"
    machine = slow_cold(payload(), _Residency(64))
    assert isinstance(next(machine), Call)
    assert run(slow_cold(payload(), _Residency(64)), BackgroundJobs()) is None
    assert "evicted" in run(slow_cold(payload(), _Residency(16)), BackgroundJobs())
    assert run(slow_cold(payload(), None), BackgroundJobs()) is None  # no ledger follows slow: trust the warm


def test_a_warm_slow_holds_skips_the_export():
    """Over vLLM, when slow holds the warmed prefix nothing is exported and the request goes unchanged."""
    exports = []
    handoff = Handoff("identity", via="vllm")
    plan = handoff.plan(FAST, SLOW, payload(), "salt", request={})
    outcome = run(handoff.execute(plan, http=exporting(exports), warmed=payload(), residency=_Residency(64)),
                  BackgroundJobs())
    assert exports == [] and outcome.request is None and not outcome.fallback
    assert outcome.reason == "slow holds the warmed prefix"
