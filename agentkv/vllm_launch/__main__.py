"""``python -m agentkv.vllm_launch``: the tier's two real vLLM servers on the dev ports, until Ctrl-C.

fast on 127.0.0.1:18001 (window 2048), slow on 18002 (window 8192, KV events on 18557, replay 18558): what
``AGENTKV_VLLM_REUSE=1 pytest tests/vllm`` reuses instead of starting its own.
"""

from __future__ import annotations

import signal
import time

from agentkv.vllm_launch import VLLMServer, ensure_models, ensure_venv, start_all
from agentkv.vllm_launch.server import kv_events_config


def main() -> None:
    python, models = ensure_venv(), ensure_models()
    fast = VLLMServer(python, models.fast, window=2048, port=18001, served_name="fast", threads_bind="0")
    slow = VLLMServer(python, models.slow, window=8192, port=18002, served_name="slow", threads_bind="1",
                      kv_events=kv_events_config(18557, 18558))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    try:
        start_all(fast, slow)
        print(f"fast {fast.base_url}  slow {slow.base_url}  ({time.monotonic() - started:.0f} s); Ctrl-C stops",
              flush=True)
        while fast.alive and slow.alive:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        fast.stop()
        slow.stop()


if __name__ == "__main__":
    main()
