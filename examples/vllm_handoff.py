"""Cross-model KV handoff between two real vLLM servers: fast exports, slow maps and loads, instead of re-prefilling.

    python examples/vllm_handoff.py [--quick]

1. Two vLLM 0.32 CPU servers start from the real-vLLM tier's venv and checkpoints (agentkv.vllm_launch), both with
   AgentKVConnector and one export store; slow is configured with a fast -> slow ridge mapper, calibrated once on
   the two checkpoints (agentkv.handoff.offline.calibrated) and cached.
2. A Session with ``Handoff("ridge", mapper=DIR, via="vllm")`` runs a conversation whose second turn outgrows
   fast's window, with warm-ahead off, so the escalation would be cold. Fast exports the prefix it just served,
   the gate reads the mapper's held-out figures, and the escalated request names the export under the handoff
   salt; slow maps it on its own device and prefills only the tail.
3. The same conversation (other text) escalates with ``handoff="replay"``: slow prefills everything.

Prints one JSON line: the tokens vLLM's /metrics counted as external_kv_transfer, what the Session counted, the
escalated request's time (replay vs mapped), and the gate's decision. The checkpoints have random weights, so the
mapper's held-out attention cosine is low and the gate, at its default floor, says replay; the mapped run opens it
(``min_attention_cosine=0``) to show the mechanics, and the line says both.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from _support import parse_args, quiet_logs

from agentkv import Backend, Session, WindowDiscovery
from agentkv.warm import CooldownMap


@contextlib.contextmanager
def connector_servers(mapper: Path) -> Iterator[tuple[Any, Any]]:
    """Fast (2048-token window) and slow (8192) real vLLM servers with AgentKVConnector and one store."""
    from agentkv.vllm_plugin import connector_config, connector_pythonpath
    from agentkv.vllm_launch import VLLMServer, ensure_models, ensure_venv, start_all

    python, models, store = ensure_venv(quiet=False), ensure_models(), Path(tempfile.mkdtemp(prefix="agentkv-kv-"))
    env = {"PYTHONPATH": str(connector_pythonpath())}
    fast = VLLMServer(python, models.fast, window=2048, served_name="fast", kv_transfer=connector_config(store),
                      extra_env=env)
    slow = VLLMServer(python, models.slow, window=8192, served_name="slow", extra_env=env,
                      kv_transfer=connector_config(store, mappers={"fast": mapper}))
    print("starting two real vLLM CPU servers with AgentKVConnector (about a minute)...", flush=True)
    try:
        start_all(fast, slow)
        yield fast, slow
    finally:
        fast.stop()
        slow.stop()


def conversation(words: int) -> list[dict[str, Any]]:
    text = f"{uuid.uuid4()} " + " ".join(f"item{i} costs {i * 7 % 13} units" for i in range(words))
    return [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": text}]


def escalate(fast: Any, slow: Any, handoff: Any, turns: int) -> tuple[Session, float]:
    """A conversation that fits fast for its first turn and outgrows it on the second; the escalated request's ms."""
    messages = conversation(120)
    with Session(Backend("hosted_vllm/fast", api_base=fast.base_url, name="fast"),
                 Backend("hosted_vllm/slow", api_base=slow.base_url, name="slow"), tenant="acme",
                 cache_salt_secret=uuid.uuid4().hex, discovery=WindowDiscovery(), cooldowns=CooldownMap(),
                 handoff=handoff) as s:
        s.completion(messages=messages, max_tokens=1, temperature=0.0)
        for _ in range(turns):
            messages = messages + [{"role": "assistant", "content": "noted"}, conversation(150)[1]]
            started = time.perf_counter()
            s.completion(messages=messages, max_tokens=1, temperature=0.0)
            elapsed = (time.perf_counter() - started) * 1e3
            if s.last_route is not None and s.last_route.role == "slow":
                return s, elapsed
    raise RuntimeError("the conversation never escalated")


def external_tokens(server: Any) -> int:
    import httpx

    from agentkv.vllm_plugin.metrics import EXTERNAL, prompt_tokens_by_source

    return prompt_tokens_by_source(httpx.get(server.root + "/metrics", timeout=10.0).text).get(EXTERNAL, 0)


def main() -> int:
    import os

    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    os.environ["AGENTKV_WARM_AHEAD"] = "0"  # no warm-ahead: the escalation is cold
    from agentkv import Handoff
    from agentkv.handoff import DEFAULT_MIN_ATTENTION_COSINE, choose_handoff
    from agentkv.handoff.offline.calibrated import ensure_calibrated
    from agentkv.handoff.served import MapperSummary
    from agentkv.vllm_launch import ensure_models

    models = ensure_models()
    mapper = ensure_calibrated(models.fast, models.slow, models.root / "mappers")
    summary = MapperSummary.read(mapper)
    gate = choose_handoff(summary, DEFAULT_MIN_ATTENTION_COSINE)
    turns = 1 if args.quick else 3
    with connector_servers(mapper) as (fast, slow):
        escalate(fast, slow, "replay", turns)  # warms both servers' code paths; not timed
        _, replay_ms = escalate(fast, slow, "replay", turns)
        before = external_tokens(slow)
        mapped, mapped_ms = escalate(fast, slow, Handoff("ridge", mapper=mapper, via="vllm", min_attention_cosine=0.0),
                                     turns)
        metrics_tokens = external_tokens(slow) - before
    stats = mapped.stats()
    print(json.dumps({
        "example": "vllm_handoff", "mapped_tokens_metrics": metrics_tokens, "mapped_tokens_session": stats["mapped_tokens"],
        "handoff_mapped": stats["handoff_mapped"], "handoff_fallbacks": stats["handoff_fallbacks"],
        "escalated_ms": {"replay": round(replay_ms, 1), "mapped": round(mapped_ms, 1)},
        "gate": {"floor": DEFAULT_MIN_ATTENTION_COSINE, "attention_cosine": summary.attention_cosine,
                 "decision": "replay" if gate.replay else "map", "reason": gate.reason, "mapped_run_floor": 0.0}}))
    return 0 if metrics_tokens > 0 and metrics_tokens == stats["mapped_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
