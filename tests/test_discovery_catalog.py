"""litellm's catalog as the window of last resort: a cloud backend imports litellm for it; a self-hosted one whose
server is down reads it only when litellm is loaded already (the import takes seconds, on the request's path)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]  # the last line: the events are logged to stdout before it


def test_a_self_hosted_backend_that_is_down_does_not_import_litellm_for_its_window():
    out = run(f"""
        import asyncio, sys
        from agentkv import Backend, WindowDiscovery
        down = Backend("hosted_vllm/gpt-4o", api_base="http://127.0.0.1:{closed_port()}/v1", name="down")
        sync = WindowDiscovery(timeout_s=2).window(down)
        info = asyncio.run(WindowDiscovery(timeout_s=2).awindow(down))
        print(sync.window, info.window, info.source, "litellm" in sys.modules)
    """)
    assert out == "None None unknown False"


def test_a_self_hosted_model_registered_with_litellm_is_read_from_its_catalog_when_the_server_is_down():
    out = run(f"""
        import sys
        from agentkv._support.env import import_litellm
        from agentkv import Backend, WindowDiscovery
        litellm = import_litellm()
        litellm.register_model({{"hosted_vllm/my-model": {{"max_input_tokens": 12345, "max_tokens": 100,
                                "litellm_provider": "hosted_vllm", "mode": "chat"}}}})
        down = Backend("hosted_vllm/my-model", api_base="http://127.0.0.1:{closed_port()}/v1", name="down")
        import asyncio
        info = WindowDiscovery(timeout_s=2).window(down)
        later = asyncio.run(WindowDiscovery(timeout_s=2).awindow(down))  # looked up on a worker thread
        print(info.window, info.source, later.window, later.source)
    """)
    assert out == "12345 catalog 12345 catalog"


def test_a_cloud_backend_imports_litellm_for_its_catalog_window():
    out = run("""
        import sys
        from agentkv import Backend, WindowDiscovery
        info = WindowDiscovery().window(Backend("openai/gpt-4o", name="cloud"))
        print(info.window is not None and info.window > 100_000, info.source, "litellm" in sys.modules)
    """)
    assert out == "True catalog True"
