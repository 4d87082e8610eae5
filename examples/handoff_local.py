"""KV handoff between two local engines: a calibrated ridge mapper instead of re-prefilling.

    python examples/handoff_local.py [--quick]

1. A "family" pair is built: the source is an embedded model, the target a depth-upscaled relative
   (the source's layers duplicated and perturbed). Real model families are trained; these have random
   weights, damped so that the relation survives, which is enough for the linear map to hold.
2. ``calibrate`` fits the ridge mapper (RoPE stripped, cross-layer selection, closed form) on a locally
   generated corpus, evaluates it (R², attention-output cosine, greedy agreement) and saves it.
3. A Session escalates a scripted conversation from the source engine to the target engine with
   ``handoff="ridge", mapper=DIR``: the source's cached prefix is mapped into the target's prefix cache,
   so the target prefills only the tail. The same conversation is then run with ``handoff="replay"``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from _support import parse_args, quiet_logs

from agentkv import Backend, Session, WindowDiscovery
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.warm import CooldownMap


def build_pair(quick: bool):
    from agentkv.handoff.offline.testing import damp_residual_writes, depth_upscaled
    from agentkv.embedded.engine.models import build_model

    size = "tiny" if quick else "small"
    source = damp_residual_writes(build_model(size, seed=0), 0.1 if quick else 0.05)
    layers = source.config.num_hidden_layers
    order = tuple(sorted(list(range(layers)) + list(range(1, layers))))  # every layer but the first, twice
    return source, depth_upscaled(source, order=order, noise=0.05)


def calibrate_pair(source, target, folder: Path, quick: bool):
    from agentkv.handoff import CalibrationConfig, calibrate
    from agentkv.handoff.offline.testing import random_sequences

    sequences = random_sequences(8 if quick else 24, 64 if quick else 256, vocab=50_000)
    started = time.perf_counter()
    mapper = calibrate(source, target, sequences, config=CalibrationConfig(k=2 if quick else 4))
    mapper.save(folder)
    evaluation = mapper.info.get("evaluation", {})
    print(f"calibrated ridge on {sum(len(s) for s in sequences)} tokens in {time.perf_counter() - started:.1f}s: "
          f"attention cosine {mapper.attention_cosine:.4f}, greedy agreement {evaluation.get('greedy_agreement')}")
    return mapper


def escalate(source, target, handoff: str, mapper_dir: Path, floor: float) -> Session:
    from agentkv.embedded.engine import LocalEngine
    from agentkv.embedded.server import LocalServer

    fast_server = LocalServer(LocalEngine(source, model_id="family-small", max_model_len=2048))
    slow_server = LocalServer(LocalEngine(target, model_id="family-large", max_model_len=16384))
    with fast_server, slow_server:
        fast = Backend("hosted_vllm/family-small", api_base=fast_server.api_base, name="fast")
        slow = Backend("hosted_vllm/family-large", api_base=slow_server.api_base, name="slow")
        agent = ScriptedAgent(result_rows=1)
        messages = agent.opening()
        with Session(fast, slow, tenant="acme", cache_salt_secret="example", discovery=WindowDiscovery(),
                     cooldowns=CooldownMap(), handoff=handoff, mapper=mapper_dir if handoff != "replay" else None,
                     min_attention_cosine=floor) as s:
            while s.last_route is None or s.last_route.role == "fast":
                started = time.perf_counter()
                s.completion(messages=messages, tools=TOOLS[:8], max_tokens=2)
                elapsed = time.perf_counter() - started
                messages = messages + agent.next_turn()
            row = s.ledger[-1]
            print(f"[{handoff:6s}] escalated at turn {row.turn} ({row.input_tokens} tokens): "
                  f"{s.stats()['mapped_tokens']} tokens mapped, slow reported {row.cached_tokens} cached, "
                  f"escalated request took {elapsed * 1000:.0f} ms")
            return s


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    import os

    os.environ["AGENTKV_WARM_AHEAD"] = "0"  # isolate the handoff: no warm-ahead in this example
    source, target = build_pair(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "small-to-large"
        mapper = calibrate_pair(source, target, folder, args.quick)
        floor = 0.95  # the default gate: below it the Session replays tokens instead
        print(f"quality gate: min_attention_cosine={floor} -> {'map' if mapper.attention_cosine >= floor else 'replay'}")
        mapped = escalate(source, target, "ridge", folder, floor)
        escalate(source, target, "replay", folder, floor)
    print(f"handoff_local: mapped_tokens={mapped.stats()['mapped_tokens']} "
          f"handoff_fallbacks={mapped.stats()['handoff_fallbacks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
