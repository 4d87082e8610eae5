"""What ``agentkv gateway`` costs: direct to the backend vs through the gateway, side by side in one run.

Backends: two embedded servers (``agentkv serve --size tiny``, each in its own process, as vLLM would be) and
real vLLM: the dev pair when it answers on 127.0.0.1:18001/18002 (``python -m agentkv.vllm_launch``), else, with
``--start-vllm``, a pair started here on the backends' cores. The gateway is ``agentkv gateway`` in a process
of its own (one worker). The client is this process.

1. Added latency, small non-streamed requests far from any boundary (a one-line prompt, ``max_tokens=1``, the
   turns of one conversation by ``x-session-id``): sequential requests on keep-alive connections, direct,
   through the gateway, and through a *byte relay* taking turns; p50 and p99 of each, the differences, and the
   median paired differences; and the gateway process's CPU time per request (``/proc``: what it adds when no
   other process competes). The byte relay is the floor any proxy pays here: a process on the gateway's core
   that copies bytes between the client's connection and one to fast (asyncio, no HTTP), so what the gateway
   adds over it is the gateway's own work. On a small VM it is most of the figure: waking a vCPU that has been
   idle for a few milliseconds (as the gateway's is while the backend computes) takes 0.1-0.3 ms.
2. Time to the first streamed byte: the same, streaming; the first body chunk's arrival.
3. Memory: 2,000 conversations (8 at a time), then the gateway's RSS per idle conversation (RSS after minus
   before, over the conversations it then holds more); and 500 concurrent streaming conversations through the
   one gateway process: errors and wall time.

    python benchmarks/gateway.py                 # about 4 minutes on 2 CPU cores (5 with the vLLM pair up)
    python benchmarks/gateway.py --start-vllm    # a real-vLLM pair of its own, pinned with the backends
    python benchmarks/gateway.py --requests 500 --concurrent 500 --no-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx

VLLM = ("http://127.0.0.1:18001/v1", "fast", "http://127.0.0.1:18002/v1", "slow")


# Where each process runs. A gateway has cores of its own, and a model server computes on its accelerator, not on
# them; here the model computes on the CPU, so the gateway gets the last CPU and the backends (one thread each) and
# this client the others: the client and a backend take turns (one waits while the other works), and the
# gateway's work never waits for either. Both sides of the comparison run under the same split. ``--no-pin`` lets
# every process share every core instead.
BACKEND_CPUS: set[int] | None = None
FRONT_CPUS: set[int] | None = None


def _pinned(cpus: set[int] | None) -> Any:
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def served(window: int, name: str) -> Iterator[str]:
    """``agentkv serve --size tiny`` in a child process on a free port; yields its api_base."""
    command = [sys.executable, "-m", "agentkv.cli", "serve", "--size", "tiny", "--window", str(window), "--port", "0",
               "--served-model-name", name, "--prefill-threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if BACKEND_CPUS else None
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                             preexec_fn=_pinned(BACKEND_CPUS))
    assert child.stdout is not None
    try:
        lines = iter(child.stdout.readline, "")
        line = next((line for line in lines if line.startswith("agentkv serve:")), "")
        if " at " not in line:
            raise RuntimeError("agentkv serve did not start")
        threading.Thread(target=lambda: [None for _ in lines], daemon=True).start()  # keep its log pipe flowing
        yield line.rsplit(" at ", 1)[1].strip()
    finally:
        child.terminate()
        try:
            child.wait(60)  # it lets requests in flight finish first
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)


class Gateway:
    """``agentkv gateway`` in a child process (its logs to a file), ready when /health answers."""

    def __init__(self, fast: str, fast_model: str, slow: str, slow_model: str, log: Path) -> None:
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "agentkv.cli", "gateway", "--fast", fast, "--fast-model", fast_model,
                   "--slow", slow, "--slow-model", slow_model, "--port", str(self.port)]
        env = {**os.environ, "AGENTKV_CACHE_SALT_SECRET": os.environ.get("AGENTKV_CACHE_SALT_SECRET", "bench"),
               "AGENTKV_GATEWAY_MAX_SESSIONS": "100000"}
        self._log = open(log, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=_pinned(FRONT_CPUS))

    def __enter__(self) -> Gateway:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.1)

    def __exit__(self, *exc: Any) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._log.close()

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


class Relay:
    """The byte relay (see the module's docstring): ``python benchmarks/gateway.py --relay-to HOST:PORT``, on the
    gateway's core, ready when it prints its port."""

    def __init__(self, api_base: str) -> None:
        target = api_base.split("://", 1)[1].split("/", 1)[0]
        self.process = subprocess.Popen([sys.executable, __file__, "--relay-to", target], stdout=subprocess.PIPE,
                                        text=True, preexec_fn=_pinned(FRONT_CPUS))
        assert self.process.stdout is not None
        self.root = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.process.kill()
        self.process.wait(10)


def relay_forever(target: str) -> None:
    """Copy bytes between each accepted connection and a new one to ``target``, both ways, until either closes."""
    host, port = target.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
        finally:
            writer.close()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    async def serve() -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY, as the gateway
        listener.bind(("127.0.0.1", 0))
        server = await asyncio.start_server(accepted, sock=listener)
        print(listener.getsockname()[1], flush=True)
        await server.serve_forever()

    asyncio.run(serve())


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) ticks of every CPU so far (``/proc/stat``; zeros elsewhere): the share a hypervisor gave
    to other guests, which slows every side of a run alike and makes its figures noisy."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def small_body(model: str, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"ping {uuid.uuid4().hex[:8]}"}],
            "max_tokens": 1, "temperature": 0, **({"stream": True} if stream else {})}


SESSION = {"x-session-id": f"bench-{uuid.uuid4()}"}  # the timed requests are turns of one conversation


def timed_json(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    response = client.post(url, json=body, headers=SESSION)
    response.read()
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def timed_first_byte(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    with client.stream("POST", url, json=body, headers=SESSION) as response:
        response.raise_for_status()
        chunks = response.iter_raw()
        next(chunks)
        elapsed = time.perf_counter() - start
        for _ in chunks:
            pass
    return elapsed


def side_by_side(direct: str, model: str, gateway: Gateway, relay: Relay, requests: int,
                 stream: bool) -> dict[str, float]:
    """Direct, relayed and gateway requests taking turns; ms quantiles of each and of the paired differences."""
    measure = timed_first_byte if stream else timed_json
    sides = {"direct": direct, "relay": relay.root + "/v1/chat/completions",
             "gateway": gateway.root + "/v1/chat/completions"}
    times: dict[str, list[float]] = {name: [] for name in sides}
    with httpx.Client(timeout=60) as client:
        for _ in range(20):  # warm the connections, the gateway's caches and the backend
            for url in sides.values():
                measure(client, url, small_body(model, stream))
        cpu, ticks = gateway.cpu_s(), cpu_ticks()
        order = list(sides)
        for _ in range(requests):
            order = order[1:] + order[:1]  # each side follows each other side as often
            for name in order:
                times[name].append(measure(client, sides[name], small_body(model, stream)))
        cpu = (gateway.cpu_s() - cpu) / requests
        steal, total = (after - before for after, before in zip(cpu_ticks(), ticks))
    ms = {f"{name}_p{int(q * 100)}": quantile(values, q) * 1000 for name, values in times.items() for q in (0.5, 0.99)}
    for name in ("relay", "gateway"):
        ms[f"{name}_added_p50"] = ms[f"{name}_p50"] - ms["direct_p50"]
        ms[f"{name}_added_p99"] = ms[f"{name}_p99"] - ms["direct_p99"]
        ms[f"{name}_paired"] = statistics.median(g - d for g, d in zip(times[name], times["direct"])) * 1000
    ms["over_relay"] = statistics.median(g - r for g, r in zip(times["gateway"], times["relay"])) * 1000
    ms["gateway_cpu"] = cpu * 1000
    ms["steal_percent"] = 100 * steal / total if total else 0.0
    return ms


async def one_stream(client: httpx.AsyncClient, url: str, model: str, n: int) -> int:
    """One conversation's streamed turn: its SSE events counted (0 on any error)."""
    body = {"model": model, "max_tokens": 8, "stream": True, "temperature": 0,
            "messages": [{"role": "system", "content": f"conversation {n} {uuid.uuid4()}"},
                         {"role": "user", "content": "stream a few tokens"}]}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return 0
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
            return events
    except httpx.HTTPError:
        return 0


async def concurrent_streams(url: str, model: str, count: int, parallel: int | None = None) -> tuple[int, float]:
    """``count`` streaming conversations, ``parallel`` at a time (all at once by default); (errors, seconds)."""
    limit = parallel or count
    limits = httpx.Limits(max_connections=limit + 10, max_keepalive_connections=limit + 10)
    gate = asyncio.Semaphore(limit)

    async def gated(client: httpx.AsyncClient, n: int) -> int:
        async with gate:
            return await one_stream(client, url, model, n)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=60, pool=300), limits=limits) as client:
        start = time.perf_counter()
        events = await asyncio.gather(*(gated(client, n) for n in range(count)))
        return sum(1 for e in events if e < 2), time.perf_counter() - start


def report(title: str, ms: dict[str, float]) -> None:
    print(f"  {title}")
    print(f"    direct   p50 {ms['direct_p50']:7.2f} ms   p99 {ms['direct_p99']:7.2f} ms")
    for name in ("relay", "gateway"):
        print(f"    {name:8s} p50 {ms[f'{name}_p50']:7.2f} ms   p99 {ms[f'{name}_p99']:7.2f} ms   added p50 "
              f"{ms[f'{name}_added_p50']:5.2f} ms, p99 {ms[f'{name}_added_p99']:5.2f} ms "
              f"(median paired difference {ms[f'{name}_paired']:.2f} ms)")
    print(f"    the gateway over the byte relay: median paired difference {ms['over_relay']:.2f} ms; "
          f"gateway process CPU per request {ms['gateway_cpu']:.2f} ms; host steal {ms['steal_percent']:.1f}%")


def bench_backend(label: str, fast: str, fast_model: str, slow: str, slow_model: str, args: argparse.Namespace,
                  log: Path, concurrency: bool) -> None:
    with Gateway(fast, fast_model, slow, slow_model, log) as gateway, Relay(fast) as relay:
        gw = gateway.root + "/v1/chat/completions"
        print(f"\n== {label}: direct {fast} vs gateway {gateway.root} vs byte relay {relay.root}")
        report("non-streamed, max_tokens=1 (latency to the whole answer)",
               side_by_side(fast + "/chat/completions", fast_model, gateway, relay, args.requests, stream=False))
        report("streamed (time to the first body byte)",
               side_by_side(fast + "/chat/completions", fast_model, gateway, relay, args.requests, stream=True))
        if not concurrency:
            return
        # idle conversations first, 8 at a time, while the heap holds little else (the concurrent run's buffers,
        # once freed, would absorb them unseen)
        before_rss, before_held = gateway.rss_bytes(), held(gateway.root)
        asyncio.run(concurrent_streams(gw, fast_model, args.idle, parallel=8))
        after_rss, after_held = gateway.rss_bytes(), held(gateway.root)
        per = (after_rss - before_rss) / max(1, after_held - before_held)
        print(f"  memory: gateway RSS {before_rss / 2**20:.1f} -> {after_rss / 2**20:.1f} MiB for "
              f"{after_held - before_held} more idle conversations: {per / 1024:.1f} KiB per idle conversation")
        errors, seconds = asyncio.run(concurrent_streams(gw, fast_model, args.concurrent))
        print(f"  {args.concurrent} concurrent streaming conversations through one gateway process: "
              f"{errors} errors, {seconds:.1f} s (gateway RSS then {gateway.rss_bytes() / 2**20:.1f} MiB)")


def held(root: str) -> int:
    for line in httpx.get(root + "/metrics", timeout=10).text.splitlines():
        if line.startswith("agentkv_gateway_sessions "):
            return int(float(line.split()[1]))
    return 0


@contextlib.contextmanager
def own_vllm_pair() -> Iterator[tuple[str, str, str, str]]:
    """The tier's two real vLLM servers started here (``--start-vllm``), on the backends' cores like the embedded
    ones (this process's affinity, which they inherit, and their compute threads bound there too)."""
    from agentkv.vllm_launch import VLLMServer, ensure_models, ensure_venv, start_all

    python, models = ensure_venv(), ensure_models()
    bind = ",".join(str(cpu) for cpu in sorted(BACKEND_CPUS)) if BACKEND_CPUS else "nobind"
    fast = VLLMServer(python, models.fast, window=2048, served_name="fast", threads_bind=bind)
    slow = VLLMServer(python, models.slow, window=8192, served_name="slow", threads_bind=bind)
    start_all(fast, slow)
    try:
        yield fast.base_url, "fast", slow.base_url, "slow"
    finally:
        fast.stop()
        slow.stop()


def vllm_up() -> bool:
    try:
        return all(httpx.get(url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
                   for url in (VLLM[0], VLLM[2]))
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="timed requests per side and mode")
    parser.add_argument("--concurrent", type=int, default=500, help="concurrent streaming conversations")
    parser.add_argument("--idle", type=int, default=2000, help="conversations added to measure memory per idle one")
    parser.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM pair even when it is up")
    parser.add_argument("--start-vllm", action="store_true", help="start a real-vLLM pair of its own, pinned like "
                        "the embedded servers (when the dev pair is not up; about 2 minutes to start)")
    parser.add_argument("--log-dir", default=None, help="where the gateways' logs go (default: a temp dir)")
    parser.add_argument("--no-pin", action="store_true", help="share every core (default: the gateway on the last "
                        "CPU, the backends and the client on the others)")
    parser.add_argument("--relay-to", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the byte relay's own process
    args = parser.parse_args()
    if args.relay_to:
        relay_forever(args.relay_to)
        return
    global BACKEND_CPUS, FRONT_CPUS
    cpus = sorted(os.sched_getaffinity(0))
    if not args.no_pin and len(cpus) >= 2:
        BACKEND_CPUS, FRONT_CPUS = set(cpus[:-1]), {cpus[-1]}
        os.sched_setaffinity(0, BACKEND_CPUS)
    import tempfile

    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="agentkv-gateway-bench-"))
    print(f"agentkv gateway benchmark ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start; "
          f"gateway logs in {logs})")
    with served(2048, "fast-tiny") as fast, served(16384, "slow-tiny") as slow:
        bench_backend("embedded server (agentkv serve --size tiny)", fast, "fast-tiny", slow, "slow-tiny", args,
                      logs / "embedded.log", concurrency=True)
    if args.no_vllm:
        return
    if vllm_up():
        bench_backend("real vLLM 0.32 (CPU), the dev pair", *VLLM, args, logs / "vllm.log", concurrency=False)
    elif args.start_vllm:
        with own_vllm_pair() as pair:
            bench_backend("real vLLM 0.32 (CPU), pinned with the backends", *pair, args, logs / "vllm.log",
                          concurrency=False)
    else:
        print("\n(real vLLM pair not running on 18001/18002, and no --start-vllm: skipped)")


if __name__ == "__main__":
    main()
