"""The vLLM router (PyPI ``vllm-router``, a Rust binary in a wheel) in a venv of its own, started in front of replicas.

For the fleet tier and ``benchmarks/fleet.py``: the router the vLLM project ships, in front of real vLLM replicas, so
that what agentkv's routing key does behind it is measured on the real thing.

    python = ensure_router()                                   # vllm-router==0.1.17, cached (light: no torch)
    with VLLMRouter(python, ["http://127.0.0.1:A", "http://127.0.0.1:B"], policy="consistent_hash") as router:
        router.base_url                                        # http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from agentkv._support.build import built_once
from agentkv.vllm_launch.server import _die_with_parent, free_port, wait_until_ready

__all__ = ["ROUTER_POLICIES", "ROUTER_VERSION", "RouterStartError", "VLLMRouter", "ensure_router"]

ROUTER_VERSION = "0.1.17"
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hash", "sticky_least_loaded")


class RouterStartError(RuntimeError):
    """The router did not become healthy; the message ends with its log's tail."""


def default_router_venv() -> Path:
    """``$AGENTKV_ROUTER_VENV``, else ``~/.cache/agentkv/vllm-router-<version>``."""
    configured = os.environ.get("AGENTKV_ROUTER_VENV")
    return Path(configured) if configured else Path.home() / ".cache" / "agentkv" / f"vllm-router-{ROUTER_VERSION}"


def ensure_router(venv: Path | None = None, *, quiet: bool = True) -> Path:
    """The ``vllm-router`` executable of a venv holding ``vllm-router==ROUTER_VERSION``, installing it when absent."""
    root = venv or default_router_venv()
    with built_once(root, root / ".agentkv-installed") as needed:
        if needed:
            flags = ["--quiet"] if quiet else []
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
            subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", *flags, "--disable-pip-version-check",
                            f"vllm-router=={ROUTER_VERSION}"], check=True)
            (root / ".agentkv-installed").write_text(ROUTER_VERSION + "\n")
    return root / "bin" / "vllm-router"


class VLLMRouter:
    """A ``vllm-router`` process in front of ``workers`` (server roots, no ``/v1``) under ``policy``; healthy (its
    ``/health`` answers and every worker is registered) when :meth:`start` returns."""

    def __init__(self, executable: Path, workers: Sequence[str], *, policy: str = "cache_aware", port: int = 0,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 120.0) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        self.executable, self.workers, self.policy = Path(executable), [w.rstrip("/") for w in workers], policy
        self.port = port or free_port()
        self.extra_args, self.start_timeout_s = tuple(extra_args), start_timeout_s
        self.log_path = Path(tempfile.gettempdir()) / f"agentkv-vllm-router-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def command(self) -> list[str]:
        return [str(self.executable), "--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy,
                "--worker-urls", *self.workers, "--prometheus-port", str(free_port()), "--prometheus-host",
                "127.0.0.1", "--log-level", "warning", *self.extra_args]

    def start(self) -> VLLMRouter:
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=_die_with_parent, cwd=tempfile.gettempdir())
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        checks = [(self.root + "/health", 2.0), (self.base_url + "/models", 5.0)]
        failure = wait_until_ready(self.process, checks, timeout_s=self.start_timeout_s, interval_s=0.3)
        if failure is not None:
            raise RouterStartError(f"vllm-router {failure}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> VLLMRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
