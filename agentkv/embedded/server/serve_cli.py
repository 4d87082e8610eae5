"""``agentkv serve``: one embedded model over vLLM's OpenAI-compatible API on 127.0.0.1.

Usage::

    agentkv serve --size small --window 2048 --port 8001 --enable-prompt-tokens-details
    agentkv serve --model-path ./ckpt --served-model-name my-model --port 8002
    agentkv serve --size tiny --num-gpu-blocks-override 256 --eviction-policy lru

Runs until Ctrl-C or SIGTERM, then shuts down cleanly. torch and transformers are imported only in :func:`run`.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from agentkv.embedded.engine.eviction import EVICTION_POLICIES
from agentkv.embedded.server.bounds import DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options."""
    parser.add_argument("--size", default="small", help="model size to build (tiny, small, large)")
    parser.add_argument("--model-path", "--model", default=None,
                        help="serve a save_pretrained folder instead of a size")
    parser.add_argument("--window", type=int, default=None, help="max_model_len (default: the size's own)")
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--served-model-name", default=None, help="model id (default agentkv-SIZE)")
    parser.add_argument("--cache-budget-mb", type=int, default=512, help="prefix-cache budget in MiB")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="bound the prefix cache to this many blocks as well as the byte budget (as vLLM's flag)")
    parser.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="fair",
                        help="which cached blocks go when the pool is full: fair (default; the cache_salt furthest "
                             "over its fair share loses its coldest block) or lru (vLLM's order)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed for a built model")
    parser.add_argument("--prefill-threads", type=int, default=None,
                        help="torch threads for prefill (default: torch's; 1 avoids oversubscription)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="fill usage.prompt_tokens_details.cached_tokens (off by default, as in vLLM)")
    parser.add_argument("--unbounded-json", action="store_true",
                        help="compile JSON schemas as given (default: add size bounds where a schema has none, so "
                             "a random-weight model's JSON closes)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs a request may ask for; -1 counts as the vocabulary (vLLM's default 20)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
                        help="answer larger request bodies 413 (default 32 MiB)")
    parser.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S,
                        help="seconds a client has to send a request's headers, and again its body (default 30)")
    parser.add_argument("--kv-events-config", default=None,
                        help="vLLM's KV events config as JSON, e.g. "
                             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                             '"replay_endpoint": "tcp://*:5558"}\'')


def _server(args: argparse.Namespace) -> Any:
    from agentkv.embedded.server import LocalServer

    engine_kwargs = {"cache_budget_bytes": args.cache_budget_mb << 20, "prefill_threads": args.prefill_threads,
                     "num_blocks": args.num_gpu_blocks_override, "eviction_policy": args.eviction_policy,
                     "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
                     "max_logprobs": args.max_logprobs, "bound_json": not args.unbounded_json,
                     "max_body_bytes": int(args.max_body_mb * (1 << 20)), "client_timeout_s": args.client_timeout}
    if args.model_path:
        return LocalServer.from_pretrained(args.model_path, window=args.window, model_id=args.served_model_name,
                                           port=args.port, kv_events_config=args.kv_events_config, **engine_kwargs)
    return LocalServer.from_size(args.size, window=args.window, model_id=args.served_model_name, port=args.port,
                                 seed=args.seed, kv_events_config=args.kv_events_config, **engine_kwargs)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit status."""
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = _server(args).start()
        print(f"agentkv serve: {server.model_id} (max_model_len={server.max_model_len}) at {server.api_base}",
              flush=True)
        while not stopping.wait(0.5):
            pass
        server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
