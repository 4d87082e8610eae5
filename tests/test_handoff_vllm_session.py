"""A Session escalating between two vLLM servers with AgentKVConnector: export on fast, gate, import on slow under
the handoff salt, and what slow reports counted (fakes for the HTTP seam and the completion client)."""

from __future__ import annotations

import json

import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv import Handoff
from agentkv.errors import ConfigurationError
from agentkv.handoff.served import MapperSummary, cold_reason
from agentkv.testing import FakeHttp, capture_events, models_answer
from agentkv.vllm_plugin import handoff_salt, mapper_digest
from agentkv.warm import CooldownMap

EXPORT_ID = "ab" * 16
SIGNATURE = {"num_layers": 2, "kv_heads": 2, "head_dim": 32, "rope_theta": 1e6, "rope_scaling": {"rope_type": "default"}}


def mapper_folder(tmp_path, cosine: float):
    folder = tmp_path / f"mapper-{cosine}"
    folder.mkdir()
    manifest = {"backend": "ridge", "format_version": 1, "evaluation": {"attention_cosine": cosine},
                "signatures": {"source": SIGNATURE, "target": {**SIGNATURE, "num_layers": 4}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "weights.safetensors").write_bytes(b"weights")
    return folder


class Slow:
    """The completion client: answers every request, an import with what the connector would report."""

    def __init__(self, loaded: int) -> None:
        self.loaded, self.calls = loaded, []

    def completion(self, **kwargs):
        self.calls.append(kwargs)
        params = (kwargs.get("extra_body") or {}).get("kv_transfer_params")
        answer = {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {}}
        if params is not None:
            answer["kv_transfer_params"] = {"agentkv": {"imported": EXPORT_ID, "tokens": self.loaded,
                                                        "reason": "mapped by 'fast'"}}
        return answer


def servers(exports: list) -> FakeHttp:
    def handle(method, url, body):
        if url.endswith("/models"):
            return models_answer("fast" if ":9/" in url else "slow", 1000 if ":9/" in url else 100_000)
        exports.append((url, body))
        return {"choices": [], "kv_transfer_params": {"agentkv": {"export_id": EXPORT_ID, "tokens": 900}}}

    return FakeHttp(handle)


def escalate(handoff: Handoff, client: Slow, monkeypatch, exports: list | None = None) -> Session:
    """Two turns: the first fits fast, the second (past fast's 1000 tokens) escalates cold (warm-ahead off)."""
    monkeypatch.setenv("AGENTKV_WARM_AHEAD", "0")
    http = servers(exports if exports is not None else [])
    fast = Backend("hosted_vllm/fast", api_base="http://127.0.0.1:9/v1", name="fast", window=1000)
    slow = Backend("hosted_vllm/slow", api_base="http://127.0.0.1:8/v1", name="slow", window=100_000)
    s = Session(fast, slow, tenant="t", cache_salt_secret="k", client=client, http=http, count_with_server=False,
                discovery=WindowDiscovery(http=http), cooldowns=CooldownMap(), handoff=handoff)
    first = [{"role": "user", "content": "word " * 100}]
    s.completion(messages=first, max_tokens=4)
    s.completion(messages=first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "word " * 2000}],
                 max_tokens=4)
    assert s.last_route.role == "slow"
    return s


def test_a_cold_escalation_exports_on_fast_and_imports_on_slow_under_the_handoff_salt(tmp_path, monkeypatch):
    """Fast is asked to export what it last served; the escalated request names the export under the handoff salt,
    and what slow reports loading is counted."""
    folder, exports, client = mapper_folder(tmp_path, 0.99), [], Slow(loaded=896)
    with capture_events() as events:
        s = escalate(Handoff("ridge", mapper=folder, via="vllm"), client, monkeypatch, exports)
    (url, body), = exports
    assert url == "http://127.0.0.1:9/v1/chat/completions"
    assert body["kv_transfer_params"] == {"agentkv": {"export": True}} and body["max_tokens"] == 1
    assert body["messages"] == [{"role": "user", "content": "word " * 100}] and body["cache_salt"] == s._parts.cache_salt
    export_call = next(c for c in s._parts.http.calls if c.url.endswith("/chat/completions"))
    assert export_call.headers == {"X-Session-ID": s.routing_key}  # a router sends the export where fast served
    assert client.calls[-1]["extra_headers"] == {"X-Session-ID": s.routing_key}
    escalated = client.calls[-1]["extra_body"]
    assert escalated["kv_transfer_params"] == {"agentkv": {"import": EXPORT_ID, "mapper": "fast"}}
    assert escalated["cache_salt"] == handoff_salt(s._parts.cache_salt, mapper_digest(folder)) != s._parts.cache_salt
    stats = s.stats()
    assert (stats["handoff_mapped"], stats["mapped_tokens"], stats["handoff_fallbacks"]) == (1, 896, 0)
    assert any(e["event"] == "handoff.imported" and e["mapped_tokens"] == 896 for e in events)


def test_an_import_slow_did_not_load_counts_as_a_fallback(tmp_path, monkeypatch):
    """When slow reports 0 tokens loaded (refused, or recomputed), the escalation counts as a fallback."""
    s = escalate(Handoff("ridge", mapper=mapper_folder(tmp_path, 0.99), via="vllm"), Slow(loaded=0), monkeypatch)
    stats = s.stats()
    assert (stats["handoff_mapped"], stats["mapped_tokens"], stats["handoff_fallbacks"]) == (0, 0, 1)


def test_the_gate_refusing_a_mapper_replays_without_exporting(tmp_path, monkeypatch):
    """A mapper below the cosine floor is refused: no export is asked and the request goes as a plain replay."""
    exports, client = [], Slow(loaded=896)
    s = escalate(Handoff("ridge", mapper=mapper_folder(tmp_path, 0.4), via="vllm"), client, monkeypatch, exports)
    assert exports == [] and "kv_transfer_params" not in client.calls[-1]["extra_body"]
    assert client.calls[-1]["extra_body"]["cache_salt"] == s._parts.cache_salt
    assert s.stats()["handoff_fallbacks"] == 1 and s.stats()["handoff_mapped"] == 0


def test_identity_between_replicas_keeps_the_tenants_salt(tmp_path, monkeypatch):
    """An identity handoff (same model) names the export without a mapper, under the tenant's own salt."""
    client = Slow(loaded=896)
    s = escalate(Handoff("identity", via="vllm"), client, monkeypatch)
    escalated = client.calls[-1]["extra_body"]
    assert escalated["kv_transfer_params"] == {"agentkv": {"import": EXPORT_ID}}
    assert escalated["cache_salt"] == s._parts.cache_salt and s.stats()["handoff_mapped"] == 1


def test_an_export_that_fails_is_a_replay(tmp_path, monkeypatch):
    """Fast answering without an export id (no connector there) falls back to replay, request unchanged."""
    from agentkv._support.effects import run
    from agentkv._support.jobs import BackgroundJobs

    monkeypatch.setenv("AGENTKV_WARM_AHEAD", "0")
    handoff = Handoff("ridge", mapper=mapper_folder(tmp_path, 0.99), via="vllm")
    http = FakeHttp(lambda method, url, body: models_answer("x", 100_000) if url.endswith("/models") else {"choices": []})
    kwargs = {"messages": []}
    plan = handoff.plan(Backend("hosted_vllm/fast", api_base="http://f/v1"), Backend("hosted_vllm/slow"), _payload(),
                        "s", request=kwargs)
    outcome = run(handoff.execute(plan, http=http), BackgroundJobs())
    assert outcome.fallback and "exported nothing" in outcome.reason and outcome.request is None
    assert kwargs == {"messages": []}


def _payload():
    from agentkv.tokens import payload_from_request

    return payload_from_request({"messages": [{"role": "user", "content": "hi"}]})


def test_a_warm_slow_needs_no_handoff():
    """A sent warm the ledger does not contradict means slow holds the prefix; an evicted one means cold."""
    assert cold_reason(warmed=False, held_tokens=None, warmed_tokens=None, block_size=None) is not None
    assert cold_reason(warmed=True, held_tokens=None, warmed_tokens=None, block_size=None) is None
    assert cold_reason(warmed=True, held_tokens=256, warmed_tokens=300, block_size=128) is None
    assert "evicted" in cold_reason(warmed=True, held_tokens=128, warmed_tokens=300, block_size=128)


def test_mapper_summary_feeds_the_gate_without_torch(tmp_path):
    """The gate reads a saved mapper's backend and held-out cosine from its manifest alone."""
    from agentkv.handoff import choose_handoff

    summary = MapperSummary.read(mapper_folder(tmp_path, 0.97))
    assert (summary.name, summary.attention_cosine) == ("ridge", 0.97)
    assert not choose_handoff(summary, 0.95).replay and choose_handoff(summary, 0.98).replay


def test_a_vllm_handoff_needs_the_mapper_folder():
    """A learned backend over vLLM must name the folder the slow server loads (an in-memory mapper cannot travel)."""
    with pytest.raises(ConfigurationError, match="folder"):
        Handoff("ridge", mapper=object(), via="vllm")
    with pytest.raises(ConfigurationError, match="via"):
        Handoff("identity", via="carrier-pigeon")


def test_an_answer_without_an_import_report_counts_nothing(tmp_path, monkeypatch):
    """A slow answer that says nothing of the import (a stream, or no connector there) is neither mapped nor a
    fallback: it is reported as unreported."""
    class Silent(Slow):
        def completion(self, **kwargs):
            answer = super().completion(**kwargs)
            answer.pop("kv_transfer_params", None)
            return answer

    with capture_events() as events:
        s = escalate(Handoff("ridge", mapper=mapper_folder(tmp_path, 0.99), via="vllm"), Silent(loaded=896), monkeypatch)
    stats = s.stats()
    assert (stats["handoff_mapped"], stats["handoff_fallbacks"], stats["mapped_tokens"]) == (0, 0, 0)
    assert any(e["event"] == "handoff.unreported" for e in events)
