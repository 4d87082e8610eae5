"""Running the gateway: in the foreground under uvicorn (one process, or ``workers`` processes on one port),
or in a daemon thread of the caller's process (tests, benchmarks, notebooks).

    serve(config)                                   # what `agentkv gateway` runs; blocks until SIGINT/SIGTERM

    with GatewayThread(config) as gateway:          # port 0 picks a free port
        openai.OpenAI(base_url=gateway.base_url, api_key="key-1")

Listening sockets are created with ``IPPROTO_TCP`` named: asyncio sets ``TCP_NODELAY`` only on sockets whose
protocol says TCP (accepted ones inherit the listener's), and without it a JSON answer's header and body
writes meet Nagle's algorithm and the client's delayed ACK (~40 ms). uvicorn's own multi-worker socket does
not name it, so the gateway binds its own.

uvicorn's proxy-headers middleware is off: the gateway reads no client address (its logs carry none), so
``X-Forwarded-For`` would only cost each request a middleware hop.
"""

from __future__ import annotations

import inspect
import os
import shutil
import socket
import tempfile
import threading
from typing import Any

from agentkv.gateway.config import CONFIG_ENV, GatewayConfig

__all__ = ["GatewayThread", "serve", "tcp_socket"]

_FACTORY = "agentkv.gateway.app:app_from_env"


def tcp_socket(host: str, port: int) -> socket.socket:
    """A bound, inheritable TCP listener (``IPPROTO_TCP`` named, so accepted sockets get ``TCP_NODELAY``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _uvicorn_config(config: GatewayConfig, **extra: Any) -> Any:
    import uvicorn

    return uvicorn.Config(_FACTORY, factory=True, host=config.host, port=config.port, workers=config.workers,
                          log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=10,
                          proxy_headers=False, **extra)


def serve(config: GatewayConfig) -> None:
    """Serve ``config`` in the foreground until interrupted (``config.workers`` processes on one port)."""
    os.environ[CONFIG_ENV] = config.to_env()  # every worker (and a single in-process server) builds its app from it
    made = None
    if config.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        made = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="agentkv-gateway-metrics-")
    try:
        _run(config)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _run(config: GatewayConfig) -> None:
    import uvicorn

    server_config = _uvicorn_config(config)
    sock = tcp_socket(config.host, config.port)
    if config.workers == 1:
        uvicorn.Server(server_config).run(sockets=[sock])
        return
    from uvicorn.supervisors import Multiprocess

    supervisor: Any = Multiprocess
    if "target" in inspect.signature(supervisor).parameters:  # older uvicorn releases take the worker's target
        supervisor(server_config, target=uvicorn.Server(server_config).run, sockets=[sock]).run()
    else:
        supervisor(server_config, sockets=[sock]).run()


class GatewayThread:
    """One gateway process's app under uvicorn in a daemon thread, on ``config.host`` (``config.port`` 0: a free
    port). ``context`` builds the shared state instead of the config's (see :func:`~agentkv.gateway.app.create_app`)."""

    def __init__(self, config: GatewayConfig, *, context: Any = None) -> None:
        from agentkv.gateway.app import create_app

        self.config = config
        self.app = create_app(config, context=context)
        self._socket = tcp_socket(config.host, config.port)
        self.port = int(self._socket.getsockname()[1])
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        return f"http://{self.config.host}:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> GatewayThread:
        """Start serving; returns once the app has started (its lifespan has run)."""
        import time

        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                                     proxy_headers=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name=f"agentkv-gateway-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the thread (in-flight streams are cut)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
        self._socket.close()

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
