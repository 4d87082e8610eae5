"""Per-request overhead of a Session against bare litellm, to the same vLLM-like server on loopback.

One embedded server (``agentkv serve --size tiny``, the ``LocalServer`` in its own process, as vLLM
would be), growing agent conversations (20 turns, 12
tools, about 110 tokens of tool output per turn, from 1.2K to 5.6K tokens). Each turn is sent once untimed (so both timed
requests find the prompt in the prefix cache), then bare ``litellm.completion`` and
``Session.completion`` are timed side by side, in alternating order. Per count mode:

- ``server``: no tokenizer declared, ``count_exactly=True``: ``/tokenize`` on every turn;
- ``template``: tokenizer and chat template declared: exact, local, incremental;
- ``estimate-first``: no tokenizer declared: the tiktoken estimate, ``/tokenize`` only near a boundary.

Prints the median overhead: the Session's time outside its litellm call (what agentkv adds: counting,
``/tokenize``, discovery, routing, recording), the paired difference Session minus bare (which also
carries the server's jitter), and the Session's time around a client that answers at once (no
litellm, no model: its own cost, free of other threads' noise); and ``/tokenize`` calls per 100 turns.

    python benchmarks/overhead.py               # about 2 minutes on 2 CPU cores
    python benchmarks/overhead.py --gap-ms 20   # an agent's tool step before each call: litellm's logging
                                                # thread then no longer contends with the timed call for the GIL
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import structlog  # noqa: E402

from agentkv import Backend, Session  # noqa: E402
from agentkv._support.env import import_litellm  # noqa: E402
from agentkv.http.transport import default_http  # noqa: E402
from agentkv.demo.script import TOOLS, ScriptedAgent  # noqa: E402
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE  # noqa: E402


@contextlib.contextmanager
def served(window: int) -> Iterator[str]:
    """``agentkv serve`` in a child process on a free port; yields its api_base."""
    command = [sys.executable, "-m", "agentkv.cli", "serve", "--size", "tiny", "--window", str(window), "--port", "0",
               "--served-model-name", "agentkv-tiny"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
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
        child.wait(10)


class CountingHttp:
    """The default HTTP seam, counting the ``/tokenize`` calls that go through it."""

    def __init__(self) -> None:
        self.http, self.tokenize = default_http(), 0

    def request(self, method: str, url: str, *, json: Any = None, headers: Any = None, timeout_s: float,
                text: bool = False) -> Any:
        self.tokenize += url.endswith("/tokenize")
        return self.http.request(method, url, json=json, headers=headers, timeout_s=timeout_s, text=text)

    async def arequest(self, method: str, url: str, *, json: Any = None, headers: Any = None, timeout_s: float,
                       text: bool = False) -> Any:
        self.tokenize += url.endswith("/tokenize")
        return await self.http.arequest(method, url, json=json, headers=headers, timeout_s=timeout_s, text=text)

    async def post(self, url: str, content: bytes, headers: Any = None) -> Any:
        return await self.http.post(url, content, headers)

    def start(self, url: str, content: bytes, headers: Any = None) -> None:
        return None

    async def aclose(self) -> None:
        await self.http.aclose()


def conversations(count: int, turns: int, rows: int) -> list[list[list[dict[str, Any]]]]:
    """``count`` conversations, each as its ``turns`` growing message lists."""
    result = []
    for seed in range(count):
        agent = ScriptedAgent(result_rows=rows, seed=seed)
        msgs, growing = agent.opening(), []
        for _ in range(turns):
            msgs = msgs + agent.next_turn()
            growing.append(msgs)
        result.append(growing)
    return result


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class TimedClient:
    """litellm, with the time spent inside each ``completion`` call recorded."""

    def __init__(self, litellm: Any) -> None:
        self.litellm = litellm
        self.inside: list[float] = []

    def completion(self, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.litellm.completion(**kwargs)
        finally:
            self.inside.append(time.perf_counter() - start)

    async def acompletion(self, **kwargs: Any) -> Any:  # pragma: no cover - the benchmark is sync
        return await self.litellm.acompletion(**kwargs)


class InstantClient(TimedClient):
    """Answers at once with an empty litellm response: what is left is the Session's own time."""

    def completion(self, **kwargs: Any) -> Any:
        self.inside.append(0.0)
        return self.litellm.ModelResponse()


def session_only(make_session: Callable[[TimedClient, CountingHttp], Session], litellm: Any,
                 convos: list[list[list[dict[str, Any]]]], tools: list[dict[str, Any]]) -> list[float]:
    """Per-turn seconds of ``Session.completion`` around a client that answers at once."""
    times = []
    for convo in convos:
        with make_session(InstantClient(litellm), CountingHttp()) as session:
            times += [_timed(functools.partial(session.completion, messages=m, tools=tools, max_tokens=1))
                      for m in convo]
    return times


def run_mode(api_base: str, litellm: Any, make_session: Callable[[TimedClient, CountingHttp], Session],
             convos: list[list[list[dict[str, Any]]]],
             tools: list[dict[str, Any]], gap_s: float = 0.0) -> tuple[list[float], list[float], list[float], int]:
    """Per-turn seconds: bare, Session, and the Session's own part (outside litellm); /tokenize calls.

    ``gap_s``: an idle pause before each timed call (an agent's tool step between two model calls), in
    which litellm's logging thread finishes the previous call's work instead of contending for the GIL."""
    bare_kwargs = {"model": "hosted_vllm/agentkv-tiny", "api_base": api_base, "max_tokens": 1}
    bare, mine, own, http = [], [], [], CountingHttp()
    for convo in convos:
        client = TimedClient(litellm)
        with make_session(client, http) as session:
            for turn, msgs in enumerate(convo):
                request = {"messages": msgs, "tools": tools}
                litellm.completion(**bare_kwargs, **request)  # untimed: both timed requests hit the cache
                pair = [functools.partial(litellm.completion, **bare_kwargs, **request),
                        functools.partial(session.completion, **request, max_tokens=1)]
                first, second = (0, 1) if turn % 2 == 0 else (1, 0)
                time.sleep(gap_s)
                times = {first: _timed(pair[first])}
                time.sleep(gap_s)
                times[second] = _timed(pair[second])
                bare.append(times[0])
                mine.append(times[1])
                own.append(times[1] - client.inside[-1])
    return bare, mine, own, http.tokenize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rows", type=int, default=2, help="tool-result rows per turn (~70 tokens each)")
    parser.add_argument("--window", type=int, default=6144)
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle pause before each timed call (an agent's tool step; 0: back to back)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    litellm = import_litellm()
    tools = TOOLS[:12]
    convos = conversations(args.conversations, args.turns, args.rows)
    with served(args.window) as api_base:
        discovered = Backend("hosted_vllm/agentkv-tiny", api_base=api_base, name="fast")
        declared = Backend("hosted_vllm/agentkv-tiny", api_base=api_base, name="fast", tokenizer="cl100k_base",
                           chat_template=CHATML_TOOLS_TEMPLATE)
        modes: dict[str, Callable[[TimedClient, CountingHttp], Session]] = {
            "server": lambda c, h: Session(discovered, count_exactly=True, client=c, http=h),
            "template": lambda c, h: Session(declared, client=c, http=h),
            "estimate-first": lambda c, h: Session(discovered, client=c, http=h),
        }
        turns = args.conversations * args.turns
        last = convos[0][-1]
        print(f"{turns} turns per mode, window {args.window}, 12 tools, last turn "
              f"{Session(declared).count(messages=last, tools=tools).total} tokens")
        for name, make in modes.items():
            bare, mine, own, tokenize = run_mode(api_base, litellm, make, convos, tools, args.gap_ms / 1000)
            alone = statistics.median(session_only(make, litellm, convos, tools))
            paired = statistics.median(m - b for b, m in zip(bare, mine))
            print(f"{name:15s} overhead median {statistics.median(own) * 1000:5.2f} ms/request (p90 "
                  f"{statistics.quantiles(own, n=10)[-1] * 1000:5.2f})   Session - bare {paired * 1000:+6.2f} ms   "
                  f"bare median {statistics.median(bare) * 1000:6.1f} ms   /tokenize per 100 turns "
                  f"{100 * tokenize / turns:5.1f}   with an instant client {alone * 1000:5.2f} ms")
        replica_choice(api_base, litellm, convos, tools)
        telemetry_hooks(api_base, litellm, convos, tools)


def replica_choice(api_base: str, litellm: Any, convos: list[list[list[dict[str, Any]]]],
                   tools: list[dict[str, Any]], rounds: int = 7) -> None:
    """What choosing a pool's replica adds per request, two ways, one server against a pool of three (its home from the
    in-process store, the ejections read), the window declared so that neither asks a server anything:

    - ``Session.route`` (the whole decision: windows, the replica, the count, the route), paired turn by turn in
      alternating order, ``rounds`` times: the median of the per-turn differences;
    - ``Session.completion`` around an instant client (everything a request does), medians side by side (noisier)."""
    from agentkv.state import InProcessStore

    common = dict(name="fast", window=6144, tokenizer="cl100k_base", chat_template=CHATML_TOOLS_TEMPLATE)
    one = Backend("hosted_vllm/agentkv-tiny", api_base=api_base, **common)  # type: ignore[arg-type]
    pool = Backend("hosted_vllm/agentkv-tiny", api_base=api_base, replicas=(api_base, "http://127.0.0.1:9/v1",
                   "http://127.0.0.1:10/v1"), **common)  # type: ignore[arg-type]
    sessions = [Session(b, client=InstantClient(litellm), state=InProcessStore()) for b in (one, pool)]
    differences = []
    for round_ in range(rounds):
        for turn, msgs in enumerate(m for convo in convos for m in convo):
            order = (0, 1) if (turn + round_) % 2 == 0 else (1, 0)
            took = {i: _timed(functools.partial(sessions[i].route, messages=msgs, tools=tools, max_tokens=1))
                    for i in order}
            differences.append(took[1] - took[0])
    times: dict[str, list[float]] = {"one server": [], "pool of 3": []}
    for _ in range(3):
        for name, backend in (("one server", one), ("pool of 3", pool)):
            times[name] += session_only(lambda c, h, b=backend: Session(b, client=c, http=h, state=InProcessStore()),
                                        litellm, convos, tools)
    single, pooled = (statistics.median(t) for t in times.values())
    print(f"choosing a replica: {statistics.median(differences) * 1000:+.4f} ms/request in Session.route (paired, "
          f"{len(differences)} turns); whole requests with an instant client: one server {single * 1000:.3f} ms, "
          f"pool of 3 {pooled * 1000:.3f} ms ({(pooled - single) * 1000:+.3f} ms, medians)")


def telemetry_hooks(api_base: str, litellm: Any, convos: list[list[list[dict[str, Any]]]],
                    tools: list[dict[str, Any]], rounds: int = 8) -> None:
    """What the OpenTelemetry hooks add per request when no SDK is configured (the default): the Session around an
    instant client with the hooks in place against the same with them removed, alternating, medians side by side."""
    from agentkv.state import InProcessStore
    from agentkv.telemetry import turns

    names = ["planned", "warmed", "try_span", "answered", "failed", "recovered", "failed_over", "handoff_span"]
    kept = {name: getattr(turns, name) for name in names}
    backend = Backend("hosted_vllm/agentkv-tiny", api_base=api_base, name="fast", window=6144, tokenizer="cl100k_base",
                      chat_template=CHATML_TOOLS_TEMPLATE)
    times: dict[str, list[float]] = {"hooks": [], "no hooks": []}
    try:
        for _ in range(rounds):
            for label in times:
                for name in names:
                    setattr(turns, name, kept[name] if label == "hooks" else (lambda *a, **k: None))
                times[label] += session_only(lambda c, h: Session(backend, client=c, http=h, state=InProcessStore()),
                                             litellm, convos[:2], tools)
    finally:
        for name in names:
            setattr(turns, name, kept[name])
    on, off = (statistics.median(t) for t in times.values())
    print(f"telemetry hooks, no SDK: {(on - off) * 1000:+.4f} ms/request (hooks {on * 1000:.3f} ms, none "
          f"{off * 1000:.3f} ms, medians with an instant client over {len(times['hooks'])} requests each)")


if __name__ == "__main__":
    main()
