"""AgentKVConnector inside real vLLM servers: exports match transformers, imports match the server's own prefill,
mapped KV shows as external tokens and stays behind its handoff salt, and anything amiss is a re-prefill.

One connector-enabled pair (fast, slow; the slow one configured with a fast -> slow ridge mapper calibrated on
the tier's checkpoints by :func:`agentkv.handoff.offline.calibrated.ensure_calibrated`) is started for the whole module
and shares one export store.
``AGENTKV_CONNECTOR_REUSE=FAST_PORT,SLOW_PORT,STORE,MAPPER`` reuses such a pair already running (both started
with ``VLLM_SERVER_DEV_MODE=1``), for a quick edit-test loop.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentkv.vllm_plugin import export_params, export_result, handoff_salt, import_params, mapper_digest
from agentkv.vllm_plugin.metrics import EXTERNAL, prompt_tokens_by_source

BLOCK = 128  # the CPU build's block size


@dataclass(frozen=True)
class Pair:
    fast: str
    slow: str
    store: Path
    mapper: Path
    servers: tuple = ()  # (fast, slow) VLLMServer s when this module started them

    @property
    def mapper_id(self) -> str:
        return mapper_digest(self.mapper)


@pytest.fixture(scope="module")
def pair(request, tmp_path_factory):
    """Fast and slow vLLM servers with the connector, one store, and the mapper the slow one loads."""
    reused = os.environ.get("AGENTKV_CONNECTOR_REUSE")
    if reused:
        fast, slow, store, mapper = reused.split(",")
        yield Pair(f"http://127.0.0.1:{fast}", f"http://127.0.0.1:{slow}", Path(store), Path(mapper))
        return
    python = request.getfixturevalue("vllm_python")
    models = request.getfixturevalue("vllm_models")
    from agentkv.vllm_plugin import connector_config, connector_pythonpath
    from agentkv.vllm_launch import VLLMServer, VLLMStartError, start_all

    from agentkv.handoff.offline.calibrated import ensure_calibrated

    root = tmp_path_factory.mktemp("connector")
    mapper = ensure_calibrated(models.fast, models.slow, models.root / "mappers")  # fitted once per checkpoint pair
    env = {"PYTHONPATH": str(connector_pythonpath()), "VLLM_SERVER_DEV_MODE": "1"}
    store = root / "store"
    fast = VLLMServer(python, models.fast, window=2048, served_name="fast", threads_bind="nobind",
                      kv_transfer=connector_config(store), extra_env=env)
    slow = VLLMServer(python, models.slow, window=8192, served_name="slow", threads_bind="nobind",
                      kv_transfer=connector_config(store, mappers={"fast": mapper}), extra_env=env)
    try:
        start_all(fast, slow)
    except VLLMStartError as exc:
        pytest.fail(f"vLLM with AgentKVConnector did not start: {exc}", pytrace=False)
    try:
        yield Pair(fast.root, slow.root, store, mapper, (fast, slow))
    finally:
        fast.stop()
        slow.stop()


def _messages(words: int = 150) -> list[dict]:
    """A unique conversation of roughly 8 tokens a word (so several 128-token blocks)."""
    text = f"{uuid.uuid4()} " + " ".join(f"item{i} costs {i * 7 % 13} units" for i in range(words))
    return [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": text}]


def _chat(root: str, model: str, messages: list[dict], *, salt: str | None, params: dict | None = None,
          max_tokens: int = 6) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 5}
    if salt is not None:
        body["cache_salt"] = salt
    if params is not None:
        body["kv_transfer_params"] = params
    answer = httpx.post(root + "/v1/chat/completions", json=body, timeout=120.0)
    answer.raise_for_status()
    return answer.json()


def _export(pair: Pair, messages: list[dict], salt: str | None) -> tuple[str, int]:
    found = export_result(_chat(pair.fast, "fast", messages, salt=salt, params=export_params(), max_tokens=1)
                          .get("kv_transfer_params"))
    assert found is not None, "the fast server returned no export id"
    return found


def _external(root: str) -> int:
    return prompt_tokens_by_source(httpx.get(root + "/metrics", timeout=10.0).text).get(EXTERNAL, 0)


def _cached(answer: dict) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _tokens(answer: dict) -> list[str]:
    return [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]


def _first_logprobs(answer: dict) -> dict[str, float]:
    return {top["token"]: top["logprob"] for top in answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def _reset_prefix_cache(root: str) -> None:
    httpx.post(root + "/reset_prefix_cache", timeout=30.0).raise_for_status()


def _salt() -> str:
    return uuid.uuid4().hex


def test_export_matches_transformers_past_key_values(pair, vllm_models):
    """An export of a prompt the server already holds in its prefix cache equals transformers' KV within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentkv.vllm_plugin.store import ExportStore

    messages, salt = _messages(), _salt()
    _chat(pair.fast, "fast", messages, salt=salt, max_tokens=1)
    answer = _chat(pair.fast, "fast", messages, salt=salt, params=export_params(), max_tokens=1)
    export_id, tokens = export_result(answer["kv_transfer_params"])
    assert _cached(answer) >= BLOCK  # the export rode on the prefix cache, not a second prefill
    manifest = ExportStore(pair.store).lookup(export_id).manifest
    assert manifest is not None and manifest.tokens == tokens == answer["usage"]["prompt_tokens"]
    keys, values, positions = ExportStore(pair.store).load(manifest, 0, tokens)
    model = AutoModelForCausalLM.from_pretrained(str(vllm_models.fast), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([manifest.token_ids]), use_cache=True).past_key_values
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert torch.allclose(k, cache.layers[layer].keys[0].permute(1, 0, 2), atol=1e-5), f"keys of layer {layer}"
        assert torch.allclose(v, cache.layers[layer].values[0].permute(1, 0, 2), atol=1e-5), f"values of layer {layer}"
    assert torch.equal(positions, torch.arange(tokens))
    assert {p.name for p in pair.store.glob(f"{export_id}*")} == {f"{export_id}.json", f"{export_id}.safetensors"}


def test_identity_import_matches_the_servers_own_prefill(pair):
    """A same-model import loads block-aligned tokens as external KV, and the greedy tokens and first-token
    logprobs equal the receiving server's own prefill within 1e-5."""
    messages, salt = _messages(), _salt()
    export_id, tokens = _export(pair, messages, salt)
    _reset_prefix_cache(pair.fast)  # the receiving server holds none of it, as a replica would not
    own = _chat(pair.fast, "fast", messages, salt=_salt())
    before = _external(pair.fast)
    loaded = _chat(pair.fast, "fast", messages, salt=salt, params=import_params(export_id))
    expected = (tokens - 1) // BLOCK * BLOCK
    assert _cached(loaded) == expected and _external(pair.fast) - before == expected
    assert _tokens(loaded) == _tokens(own)
    mine, theirs = _first_logprobs(loaded), _first_logprobs(own)
    assert mine.keys() == theirs.keys()
    assert max(abs(mine[t] - theirs[t]) for t in mine) < 1e-5
    assert not (pair.store / f"{export_id}.json").exists()  # what was imported is deleted


def test_mapped_import_shows_as_external_tokens_on_the_slow_server(pair):
    """Fast's export mapped into slow under the handoff salt is counted as external_kv_transfer and answered."""
    messages, salt = _messages(), _salt()
    export_id, tokens = _export(pair, messages, salt)
    before = _external(pair.slow)
    answer = _chat(pair.slow, "slow", messages, salt=handoff_salt(salt, pair.mapper_id),
                   params=import_params(export_id, mapper="fast"))
    expected = (tokens - 1) // BLOCK * BLOCK
    assert _external(pair.slow) - before == expected and _cached(answer) == expected
    assert answer["choices"][0]["message"]["content"] is not None and answer["usage"]["completion_tokens"] > 0


def test_mapped_blocks_never_serve_an_exact_or_another_tenants_request(pair):
    """After a mapped import, the tenant's exact request (ordinary salt) and another tenant's request, even one
    naming a fresh export, get no token from the mapped blocks."""
    messages, salt = _messages(), _salt()
    export_id, _ = _export(pair, messages, salt)
    mapped = _chat(pair.slow, "slow", messages, salt=handoff_salt(salt, pair.mapper_id),
                   params=import_params(export_id, mapper="fast"))
    assert _cached(mapped) >= BLOCK
    assert _cached(_chat(pair.slow, "slow", messages, salt=salt)) == 0
    other = _salt()
    assert _cached(_chat(pair.slow, "slow", messages, salt=other)) == 0
    again, _ = _export(pair, messages, salt)  # the first tenant's export, named by the other tenant
    before = _external(pair.slow)
    refused = _chat(pair.slow, "slow", messages, salt=handoff_salt(other, pair.mapper_id),
                    params=import_params(again, mapper="fast"))
    assert _cached(refused) == 0 and _external(pair.slow) == before


def test_a_missing_export_is_a_plain_re_prefill(pair):
    """Naming an export that is not in the store loads nothing and answers exactly as a replay does."""
    messages = _messages()
    replay = _chat(pair.slow, "slow", messages, salt=_salt())
    before = _external(pair.slow)
    salt = _salt()
    missing = _chat(pair.slow, "slow", messages, salt=handoff_salt(salt, pair.mapper_id),
                    params=import_params(uuid.uuid4().hex, mapper="fast"))
    assert _external(pair.slow) == before and _cached(missing) == 0
    assert _tokens(missing) == _tokens(replay)


def test_an_export_that_fails_to_load_is_recomputed(pair):
    """An export whose tensors were altered after its manifest passes the scheduler's checks, fails in the worker,
    and vLLM's recompute policy re-prefills: the answer equals the server's own prefill."""
    messages, salt = _messages(), _salt()
    export_id, _ = _export(pair, messages, salt)
    tensors = pair.store / f"{export_id}.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-64:] = bytes(64)
    tensors.write_bytes(bytes(data))
    _reset_prefix_cache(pair.fast)
    own = _chat(pair.fast, "fast", messages, salt=_salt())
    broken = _chat(pair.fast, "fast", messages, salt=salt, params=import_params(export_id))
    assert _tokens(broken) == _tokens(own)
    mine, theirs = _first_logprobs(broken), _first_logprobs(own)
    assert max(abs(mine[t] - theirs[t]) for t in mine) < 1e-5


def test_an_export_of_another_model_without_a_mapper_is_refused(pair):
    """Fast's export named on the slow server without a mapper loads nothing: the models differ."""
    messages, salt = _messages(), _salt()
    export_id, _ = _export(pair, messages, salt)
    before = _external(pair.slow)
    answer = _chat(pair.slow, "slow", messages, salt=salt, params=import_params(export_id))
    assert _external(pair.slow) == before and _cached(answer) == 0


def test_a_session_escalating_cold_hands_the_prefix_over_through_the_connector(pair, monkeypatch):
    """A Session whose second turn outgrows fast exports what fast served, slow maps it in, and the Session counts
    the tokens slow reports, which vLLM's metrics show as external KV."""
    from agentkv import Backend, Session, WindowDiscovery
    from agentkv import Handoff
    from agentkv.warm import CooldownMap

    monkeypatch.setenv("AGENTKV_WARM_AHEAD", "0")  # no warm-ahead: the escalation would be cold
    fast = Backend("hosted_vllm/fast", api_base=pair.fast + "/v1", name="fast")
    slow = Backend("hosted_vllm/slow", api_base=pair.slow + "/v1", name="slow")
    handoff = Handoff("ridge", mapper=pair.mapper, via="vllm", min_attention_cosine=0.0)  # random weights: gate open
    first = _messages(120)
    before = _external(pair.slow)
    with Session(fast, slow, tenant="t", cache_salt_secret=uuid.uuid4().hex, discovery=WindowDiscovery(),
                 cooldowns=CooldownMap(), handoff=handoff) as s:
        s.completion(messages=first, max_tokens=2, temperature=0.0)
        assert s.last_route.role == "fast"
        grown = first + [{"role": "assistant", "content": "noted"}, _messages(150)[1]]
        answer = s.completion(messages=grown, max_tokens=2, temperature=0.0)
    assert s.last_route.role == "slow" and answer.choices[0].message is not None
    stats = s.stats()
    assert stats["handoff_mapped"] == 1 and stats["handoff_fallbacks"] == 0
    assert stats["mapped_tokens"] >= 7 * BLOCK and stats["mapped_tokens"] % BLOCK == 0
    assert _external(pair.slow) - before == stats["mapped_tokens"]


def test_exports_survive_restarts_of_both_servers(pair):
    """After fast crashes and slow restarts (both at once), an export written before loads on the new slow (mapper
    reloaded, store kept), and the new fast, its prefix cache empty, exports the same prefix under the same id."""
    if not pair.servers:
        pytest.skip("needs the servers this module started (not AGENTKV_CONNECTOR_REUSE)")
    fast, slow = pair.servers
    messages, salt = _messages(), _salt()
    export_id, tokens = _export(pair, messages, salt)
    fast.kill()
    slow.stop()
    fast.launch()
    slow.launch()
    fast.wait_ready()
    slow.wait_ready()
    expected = (tokens - 1) // BLOCK * BLOCK
    handoff = handoff_salt(salt, pair.mapper_id)
    loaded = _chat(pair.slow, "slow", messages, salt=handoff, params=import_params(export_id, mapper="fast"))
    assert _cached(loaded) == expected
    again, _ = _export(pair, messages, salt)
    assert again == export_id
    _reset_prefix_cache(pair.slow)  # so the second import, not the first one's blocks, supplies the prefix
    before = _external(pair.slow)
    reloaded = _chat(pair.slow, "slow", messages, salt=handoff, params=import_params(again, mapper="fast"))
    assert _cached(reloaded) == expected and _external(pair.slow) - before == expected
