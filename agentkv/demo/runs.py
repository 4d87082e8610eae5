"""The demo's runs: a scripted ReAct agent on two embedded servers, warm-ahead against cold.

Two vLLM-compatible servers start on free loopback ports: fast (small model, 2048-token window) and
slow (larger model, 16384-token window). A scripted agent's conversation grows turn by turn through
``Session`` -> litellm -> HTTP. The run is made twice: with warm-ahead, and cold (warm-ahead off and
another tenant's ``cache_salt``, so the slow server has nothing of the first run to hit). The headline
compares the escalated turn's time to first token in the two runs.
"""

from __future__ import annotations

from pathlib import Path

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

TRAINED = ("The embedded models are a small family trained on this machine on the Python standard library: "
           "their text is the models' own, at the quality a few minutes of CPU training buys. The timings, token counts, "
           "routing and prefix-cache hits are real: every request goes Session -> HTTP -> a torch model.")
REAL_VLLM = ("The models are random-weight Qwen3 checkpoints built here, served by the real vLLM 0.32 CPU build: their "
             "text is meaningless. The timings, token counts, routing and prefix-cache hits are vLLM's own.")
HONESTY = ("The embedded models have random weights: their text is meaningless. The timings, token counts, "
           "routing and prefix-cache hits are real: every request goes Session -> litellm -> HTTP -> a torch model.")


@dataclass
class TurnRow:
    """One turn of a demo run, as the table and the plot show it."""

    turn: int
    input_tokens: int
    tools_share: float
    window_share: float
    backend: str
    reason: str
    warm: str
    ttft_s: float
    cached_tokens: int | None


@dataclass
class DemoRun:
    label: str
    rows: list[TurnRow] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    slow_requests_before_escalation: int = 0  # warms: every request slow served before the escalated turn
    slow_prefill_before_escalation: int = 0  # tokens slow prefilled (prompt minus prefix-cache hits) for them
    ledger: Path | None = None  # the run's turn ledger, when the config asked for it (agentkv report draws it)

    def escalation(self) -> TurnRow | None:
        return next((r for r in self.rows if r.reason in ("proactive", "reactive_escalate")), None)

    def last_fast_turn(self) -> TurnRow | None:
        """The last turn fast answered before the escalation (one turn smaller than it)."""
        escalation = self.escalation()
        before = [r for r in self.rows if escalation is None or r.turn < escalation.turn]
        return before[-1] if before else None

    @property
    def warms_sent(self) -> int:
        return sum(self.stats.get(k, 0) for k in ("warm_fired", "warm_rewarm_evicted", "warm_top_up"))


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and pacing of a demo run."""

    fast_size: str = "small"
    slow_size: str = "large"
    fast_window: int = 2048
    slow_window: int = 16384
    tools: int = 14
    turns_after_escalation: int = 2
    max_turns: int = 12
    tool_latency_s: float = 0.3
    think_time_s: float = 150.0
    max_tokens: int = 16
    result_rows: int = 1
    warm_timeout_s: float = 30.0

    trained: str | None = None  # a family recipe ("micro", "full"): trained models instead of random weights
    engine: str = "embedded"  # "vllm": the real vLLM CPU build (agentkv.vllm_launch) serves the tier's checkpoints
    top_up_tokens: int = 1024  # event-aware runs (run_modes) only
    ledger_dir: str | None = None  # where each run's turn ledger is written (agentkv-demo-<run>.jsonl), if anywhere

    @classmethod
    def quick(cls) -> "DemoConfig":
        return cls(fast_size="tiny", slow_size="tiny", turns_after_escalation=1, tool_latency_s=0.05, max_tokens=4)


def run_both(config: DemoConfig, console: Any = None) -> tuple[DemoRun, DemoRun]:
    """Start both servers, run the conversation warm then cold, stop the servers."""
    say = console.print if console else (lambda *_: None)
    sizes = ("real vLLM ", "real vLLM ") if config.engine == "vllm" else (config.fast_size, config.slow_size)
    say(f"starting fast ({sizes[0]}, window {config.fast_window}) and slow ({sizes[1]}, "
        f"window {config.slow_window}) servers on 127.0.0.1 ...")
    with _pair(config) as (fast, slow):
        _warm_up_kernels(fast, slow, _demo_tools(config))
        say("run 1: warm-ahead on")
        warm = _run(config, fast, slow, "warm-ahead", tenant="demo-warm", warm=True)
        say("run 2: cold (warm-ahead off, another tenant's salt)")
        cold = _run(config, fast, slow, "cold", tenant="demo-cold", warm=False)
    return warm, cold


def run_modes(config: DemoConfig, console: Any = None) -> tuple[DemoRun, DemoRun, DemoRun]:
    """Cooldown-only warm-ahead, event-aware warm-ahead (a :class:`~agentkv.cache_ledger.CacheLedger` following slow)
    and cold, in lockstep on one pair of servers (slow publishing KV events): every turn is sent by each mode's
    Session in turn (another tenant's salt each), so the escalated turns are measured within seconds of each other.
    Each run stops at its escalation (``turns_after_escalation`` is not used)."""
    from agentkv import Session, WarmAheadPolicy
    from agentkv.cache_ledger import CacheLedger
    from agentkv.testing import FakeClock
    from agentkv.warm import CooldownMap

    with _pair(config, kv_events=True) as (fast, slow):
        _warm_up_kernels(fast, slow, _demo_tools(config))
        fast_backend, plain = _backends(fast, slow)
        followed = replace(plain, kv_events=slow.kv_events.endpoint, kv_events_replay=slow.kv_events.replay_endpoint)
        with CacheLedger([followed]) as ledger:
            lanes = []
            for label, slow_backend, warm, cache_ledger in (("cooldown", plain, True, None),
                                                            ("event-aware", followed, True, ledger),
                                                            ("cold", plain, False, None)):
                clock = FakeClock()
                policy = WarmAheadPolicy(timeout_s=config.warm_timeout_s, enabled=warm,
                                         top_up_tokens=config.top_up_tokens)
                session = Session(fast_backend, slow_backend, tenant=f"bench-{label}", warm_ahead=policy,
                                  cache_salt_secret=f"demo-{time.time_ns()}", cooldowns=CooldownMap(timer=clock),
                                  cache_ledger=cache_ledger)
                lanes.append(_Lane(DemoRun(label), session, clock))
            _run_lanes(config, slow, lanes, console)
    plain_run, aware_run, cold_run = (lane.run for lane in lanes)
    return plain_run, aware_run, cold_run


@dataclass
class _Lane:
    """One mode's run in :func:`run_modes`: its rows, its Session, its cooldown clock."""

    run: DemoRun
    session: Any
    clock: Any
    done: bool = False


def _run_lanes(config: DemoConfig, slow: Any, lanes: list[_Lane], console: Any) -> None:
    from agentkv.demo.script import TOOLS, ScriptedAgent

    agent, tools = ScriptedAgent(result_rows=config.result_rows), TOOLS[: config.tools]
    messages = agent.opening()
    for _ in range(config.max_turns):
        for lane in (lane for lane in lanes if not lane.done):
            before = slow.engine.stats()
            lane.run.rows.append(_turn(lane.session, messages, tools, config))
            lane.done = lane.session.last_route.role == "slow"
            if not lane.done:  # the turn went to fast: what slow did meanwhile was this lane's warms
                lane.session.drain_warms(120)
                after = slow.engine.stats()
                lane.run.slow_requests_before_escalation += after.requests_started - before.requests_started
                lane.run.slow_prefill_before_escalation += (after.prompt_tokens - after.prefix_cache_hits) - (
                    before.prompt_tokens - before.prefix_cache_hits)
            lane.clock.advance(config.think_time_s)
            lane.run.stats = lane.session.stats()
        if all(lane.done for lane in lanes):
            return
        if console:
            console.print(f"turn {len(lanes[0].run.rows)} done")
        time.sleep(config.tool_latency_s)
        messages = messages + agent.next_turn()


@contextlib.contextmanager
def _pair(config: DemoConfig, kv_events: bool = False) -> Iterator[tuple[Any, Any]]:
    """Fast and slow, started and stopped: embedded servers, or real vLLM ones (``engine="vllm"``)."""
    if config.engine == "vllm":
        from agentkv.vllm_launch.pair import real_pair

        with real_pair(fast_window=config.fast_window, slow_window=config.slow_window, slow_events=kv_events) as pair:
            yield pair
        return
    from agentkv.embedded.server import LocalServer

    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    fast, slow = _servers(config, LocalServer, kv_events_config=events if kv_events else None)
    with fast, slow:
        yield fast, slow


def _servers(config: DemoConfig, server: Any, kv_events_config: Any = None) -> tuple[Any, Any]:
    """The two servers: random-weight models of the configured sizes, or the trained family's small and large."""
    if config.trained is None:
        return (server.from_size(config.fast_size, window=config.fast_window, model_id=f"agentkv-{config.fast_size}-fast"),
                server.from_size(config.slow_size, window=config.slow_window, model_id=f"agentkv-{config.slow_size}-slow",
                                 seed=1, kv_events_config=kv_events_config))
    from agentkv.embedded.family import FAMILY, ensure_family

    paths = ensure_family(config.trained, progress=True, only=FAMILY)  # trains small and large unless cached
    return (server.from_pretrained(paths.small, window=config.fast_window, model_id="agentkv-trained-small"),
            server.from_pretrained(paths.large, window=config.slow_window, model_id="agentkv-trained-large",
                                   kv_events_config=kv_events_config))


def _backends(fast: Any, slow: Any) -> tuple[Any, Any]:
    from agentkv import Backend

    return (Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base, name="fast"),
            Backend(f"hosted_vllm/{slow.model_id}", api_base=slow.api_base, name="slow"))


def _demo_tools(config: DemoConfig) -> list[dict[str, Any]]:
    from agentkv.demo.script import TOOLS

    return list(TOOLS[: config.tools])


def _warm_up_kernels(fast: Any, slow: Any, tools: list[dict[str, Any]] | None = None) -> None:
    """Unrelated requests to each server shaped like the demo's (tools, a stream, a prompt of some length) under a
    salt of their own, so first-call costs (imports, kernels, a real vLLM's first tool-call parse and first long
    prefill) stay out of both runs' tables alike."""
    from agentkv._support.env import import_litellm

    litellm = import_litellm()
    litellm.suppress_debug_info = True
    filler = "kernel warm-up, unrelated to the demo. " * 8  # with the tools, well inside fast's window
    for server in (fast, slow):
        for stream in (False, True):
            try:
                answer = litellm.completion(model=f"hosted_vllm/{server.model_id}", api_base=server.api_base,
                                            max_tokens=2, messages=[{"role": "user", "content": filler}],
                                            tools=tools or None, stream=stream,
                                            extra_body={"cache_salt": f"warm-up-{stream}"})
                if stream:
                    for _ in answer:
                        pass
            except Exception:  # noqa: BLE001 - a warm-up that fails only leaves first-call costs in the table
                continue


def _run(config: DemoConfig, fast: Any, slow: Any, label: str, *, tenant: str, warm: bool) -> DemoRun:
    from agentkv import Session, WarmAheadPolicy
    from agentkv.demo.script import TOOLS, ScriptedAgent
    from agentkv.testing import FakeClock
    from agentkv.warm import CooldownMap

    agent, tools, result = ScriptedAgent(result_rows=config.result_rows), TOOLS[: config.tools], DemoRun(label)
    messages = agent.opening()
    clock = FakeClock()
    policy = WarmAheadPolicy(timeout_s=config.warm_timeout_s, enabled=warm)
    with Session(*_backends(fast, slow), tenant=tenant, cache_salt_secret=f"demo-{time.time_ns()}",
                 cooldowns=CooldownMap(timer=clock), warm_ahead=policy) as session:
        after = 0
        for _ in range(config.max_turns):
            result.rows.append(_turn(session, messages, tools, config))
            after += session.last_route.role == "slow"
            if after > config.turns_after_escalation:
                break
            time.sleep(config.tool_latency_s)  # the agent runs its tool
            session.drain_warms(120)  # a warm fired this turn completes during the user's think time ...
            clock.advance(config.think_time_s)  # ... which the cooldown clock is told about
            messages = messages + agent.next_turn()
        result.stats = session.stats()
        if config.ledger_dir is not None:
            result.ledger = session.write_ledger(Path(config.ledger_dir) / f"agentkv-demo-{label}.jsonl")
    return result


def _turn(session: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], config: DemoConfig) -> TurnRow:
    start = time.perf_counter()
    ttft = None
    stream = session.completion(messages=messages, tools=tools, max_tokens=config.max_tokens, stream=True,
                                stream_options={"include_usage": True})
    for chunk in stream:
        if ttft is None and _carries_output(chunk):
            ttft = time.perf_counter() - start
    entry, decision = session.ledger[-1], session.last_route
    return TurnRow(entry.turn, entry.input_tokens, entry.tools_share, entry.input_tokens / config.fast_window,
                   decision.backend, decision.reason, entry.warm, ttft or 0.0, entry.cached_tokens)


def _carries_output(chunk: Any) -> bool:
    """A chunk with generated text or a finish reason: the first one marks time to first token."""
    choices = getattr(chunk, "choices", None) or []
    return any(getattr(c.delta, "content", None) or getattr(c, "finish_reason", None) for c in choices)
