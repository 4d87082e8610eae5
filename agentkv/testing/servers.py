"""Servers for tests, started for the length of a ``with`` block: two embedded vLLM-compatible servers (they load
torch) and a throwaway ``redis-server`` (the binary). Import this module only where one is used:
``import agentkv.testing`` starts and loads nothing.

    from agentkv.testing.servers import embedded_servers, redis_server

    with embedded_servers() as (fast, slow):          # two vLLM-compatible servers on 127.0.0.1
        Session(fast.backend(), slow.backend())
    with redis_server() as url:
        Session(fast, slow, state=RedisStore.from_url(url))
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

__all__ = ["embedded_servers", "free_port", "redis_server"]


@contextlib.contextmanager
def embedded_servers(
    fast_size: str = "small",
    slow_size: str = "large",
    *,
    fast_window: int = 2048,
    slow_window: int = 16384,
    **server_kwargs: Any,
) -> Iterator[tuple[Any, Any]]:
    """Start two embedded vLLM-compatible servers on free loopback ports; stop them on exit.

    Yields ``(fast_server, slow_server)``; each has ``api_base``, ``model_id`` and ``backend()``, and keeps its
    last 10,000 requests in ``requests`` for the test to inspect (``request_log=0`` keeps none).
    """
    from agentkv.embedded.server import LocalServer

    server_kwargs.setdefault("request_log", 10_000)
    fast = LocalServer.from_size(fast_size, window=fast_window, **server_kwargs)
    slow = LocalServer.from_size(slow_size, window=slow_window, **server_kwargs)
    with fast, slow:
        yield fast, slow


@contextlib.contextmanager
def redis_server(port: int | None = None, *, binary: str = "redis-server", ready_s: float = 10.0) -> Iterator[str]:
    """A throwaway ``redis-server`` on 127.0.0.1 (no persistence) for the length of a ``with``; yields its URL.

        with redis_server() as url:
            Session(fast, slow, state=RedisStore.from_url(url))

    Raises ``RuntimeError`` when the binary is missing or the server does not answer in ``ready_s``.
    """
    import shutil
    import socket
    import subprocess

    if shutil.which(binary) is None:
        raise RuntimeError(f"{binary} is not installed (Debian: apt-get install redis-server)")
    port = port or free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{binary} did not start on port {port}") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the operating system's pick)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
