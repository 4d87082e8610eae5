"""How late the first warm of a fresh process reaches the slow server: raw POST over the HTTP seam vs litellm.

Each path runs in its own fresh interpreter (litellm not yet imported): two tiny embedded servers
start, a Session observes one request past 60% of the fast window, and the time from the
``warm_fired`` event to the warm appearing in the slow server's request log is measured (polled every
millisecond). The litellm path is forced by giving the slow backend an ``api_key`` (warms to keyed
backends still go through litellm). Best of three runs per path.

    python benchmarks/first_warm.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

CHILD = "--child"


def child(path: str) -> None:
    from agentkv import Backend, Session
    from agentkv.testing import capture_events
    from agentkv.testing.servers import embedded_servers

    with embedded_servers("tiny", "tiny") as (fast, slow):
        key = "benchmark-key" if path == "litellm" else None
        s = Session(Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base, name="fast"),
                    Backend(f"hosted_vllm/{slow.model_id}", api_base=slow.api_base, name="slow", api_key=key))
        messages = [{"role": "user", "content": "latency rose on the storage hosts. " * 200}]
        with capture_events() as events:
            s.observe(messages=messages, max_tokens=4)
            fired = time.monotonic()
        assert any(e["event"] == "warm_fired" for e in events)
        while not any(r.path == "/v1/chat/completions" for r in slow.requests):
            if time.monotonic() - fired > 30:
                raise SystemExit("no warm reached slow in 30 s")
            time.sleep(0.001)
        late = time.monotonic() - fired
        s.drain_warms(60)  # let the warm finish before the servers stop
        print(f"first_warm_s={late:.4f}", flush=True)


def _late(output: str) -> float:
    found = re.search(r"first_warm_s=([0-9.]+)", output)
    if found is None:
        raise SystemExit(f"the child printed no figure:\n{output[-2000:]}")
    return float(found.group(1))


def main() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"}
    results = {}
    for path in ("raw", "litellm"):
        runs = [_late(subprocess.run([sys.executable, __file__, CHILD, path], env=env, capture_output=True,
                                     text=True).stdout) for _ in range(3)]
        results[path] = min(runs)
        print(f"{path:>8}: first warm on the wire {results[path]:.3f} s after it fired (best of {runs})")
    print(f"litellm path / raw path: {results['litellm'] / results['raw']:.1f}x")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        child(sys.argv[2])
    else:
        main()
