"""``agentkv serve`` binds to loopback, answers, and shuts down cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.embedded.server import serve_cli

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def test_arguments_and_defaults():
    """The serve options parse with small/2048-style defaults left to the size."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--size", "large", "--window", "8192", "--port", "0", "--cache-budget-mb", "64"])
    assert (args.size, args.window, args.port, args.cache_budget_mb) == ("large", 8192, 0, 64)
    assert args.model_path is None and args.served_model_name is None
    assert args.enable_prompt_tokens_details is False and args.max_logprobs == 20  # vLLM's defaults
    assert (args.eviction_policy, args.num_gpu_blocks_override) == ("fair", None)


def test_the_eviction_flags_reach_the_engine():
    """--eviction-policy and --num-gpu-blocks-override configure the served engine's prefix cache."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--size", "tiny", "--port", "0", "--eviction-policy", "lru",
                              "--num-gpu-blocks-override", "64"])
    server = serve_cli._server(args)
    server.stop()
    assert (server.engine.prefix_cache.policy, server.engine.prefix_cache.num_blocks) == ("lru", 64)
    with pytest.raises(SystemExit):
        parser.parse_args(["--eviction-policy", "lfu"])


def test_serve_answers_then_stops_on_sigterm():
    """A served process answers /v1/models on 127.0.0.1 and exits 0 on SIGTERM."""
    code = ("import sys; from agentkv.embedded.server import serve_cli as s; import argparse; p = argparse.ArgumentParser(); "
            "s.add_arguments(p); sys.exit(s.run(p.parse_args(sys.argv[1:])))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code, "--size", "tiny", "--port", "0", "--window", "512",
                                "--served-model-name", "cli-model"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        match = None
        for line in process.stdout:  # structlog events share stdout with the ready line
            match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            if match:
                break
        assert match, "the server never printed its address"
        card = httpx.get(match.group(1) + "/v1/models", timeout=10).json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("cli-model", 512)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
