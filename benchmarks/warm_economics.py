"""Warm economics: what warm-ahead's prefills buy on a population where most sessions never escalate.

A seeded synthetic population of agent sessions runs on the embedded servers (fast: tiny model; slow: a
larger one whose prefix cache is sized so blocks get evicted). Conversation lengths are heavy-tailed
(Pareto: many sessions end before they ever leave fast), think times vary per session (lognormal), and
every turn's tool output has a varied size. Sessions interleave on one simulated clock: think time is told
to the clock (the cooldowns and the break-even gate read it), never slept, and the slow cache's
evictions come from the other sessions' traffic (LRU, vLLM's order, unless ``--eviction fair``). Every mode has
its own pair of servers and all modes play each turn back to back (lockstep), so their times to first token
are measured under the same machine load. The modes:

- cold: warm-ahead off (the baseline every escalation's time to first token is compared with);
- cooldown-only: the seed's warm-ahead (one warm per session per 5 minutes past 60% of the window);
- event-aware: the same with a CacheLedger following the slow server (issue 15 item 3), when this build's
  Session accepts ``cache_ledger=``;
- break-even gate: cooldown-only plus ``WarmAheadPolicy(break_even=True)``, its cache lifetime set to the
  median residency of evicted blocks in a cooldown-only calibration pass (or ``--lifetime-s``);
- event-aware+gate (with a ledger), and ``--gate-lifetimes`` rows: the gate under other lifetime settings.

For each mode it prints: prefill tokens spent on warms, the share no escalation read, escalation TTFT saved
per 1K warm tokens (against the cold run, session by session; end to end and the engine's own), escalation
tokens found cached per 1K warm tokens (load-independent), and the share of escalations that found a warm
cache (at least half their prompt cached).

    python benchmarks/warm_economics.py                       # a few minutes on 2 CPU cores
    python benchmarks/warm_economics.py --sessions 200 --slow-size large --cache-tokens 65536   # scale up
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import structlog

from agentkv import Backend, RoutePolicy, Session, WarmAheadPolicy
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.embedded.server import LocalServer
from agentkv.testing import FakeClock
from agentkv.warm import CooldownMap, InFlightLimit

SECRET = "warm-economics"
WARMS_SENT = ("warm_fired", "warm_rewarm_evicted", "warm_top_up")  # the counters of warms that went out


@dataclass(frozen=True)
class Plan:
    """One synthetic session: when it starts, how many turns it lasts, its think times and tool output rows."""

    index: int
    arrival_s: float
    turns: int
    think_s: tuple[float, ...]
    rows: tuple[int, ...]


def population(args: argparse.Namespace) -> list[Plan]:
    """Seeded sessions: Pareto turn counts, a lognormal pace per session, lognormal tool output sizes."""
    rng = random.Random(args.seed)
    plans = []
    for i in range(args.sessions):
        turns = min(args.max_turns, math.ceil(args.min_turns * (1.0 - rng.random()) ** (-1.0 / args.alpha)))
        pace = rng.lognormvariate(math.log(args.think_median_s), args.think_sigma)
        verbosity = rng.lognormvariate(math.log(args.rows_median), 0.5)
        think = tuple(pace * rng.lognormvariate(0.0, 0.3) for _ in range(turns))
        rows = tuple(max(1, min(40, round(verbosity * rng.lognormvariate(0.0, 0.6)))) for _ in range(turns))
        plans.append(Plan(i, rng.uniform(0.0, args.arrivals_s), turns, think, rows))
    return plans


@dataclass
class SessionResult:
    """What one session did in one mode (``warm_prefill``: the slow server's new prefill during its fast turns)."""

    warms: int = 0
    warm_prefill: int = 0
    escalated_turn: int | None = None
    escalation_ttft_s: float = 0.0
    escalation_server_ttft_s: float = 0.0
    escalation_input: int = 0
    escalation_cached: int = 0

    @property
    def warm_tokens_read(self) -> int:
        """Warm prefill the escalation found cached (this session's salt: only its own warms can be hit)."""
        return min(self.warm_prefill, self.escalation_cached) if self.escalated_turn is not None else 0


@dataclass
class ModeResult:
    name: str
    sessions: list[SessionResult] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    slow_new_prefill: int = 0
    sim_s: float = 0.0
    lifetimes_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


class LifetimeProbe:
    """Times each slow-cache block from stored to evicted on the simulated clock (what KV events tell a ledger)."""

    def __init__(self, cache: Any, clock: FakeClock) -> None:
        self._stored: dict[bytes, float] = {}
        self.lifetimes_s: list[float] = []
        self._clock, self._next = clock, cache.on_events
        cache.on_events = self

    def remove(self, cache: Any) -> None:
        """Give the cache back its own listener (the next mode installs a fresh probe)."""
        cache.on_events = self._next

    def __call__(self, events: list[Any]) -> None:
        now = self._clock()
        for event in events:
            if event.kind == "stored":
                self._stored.update((h, now) for h in event.hashes)
            elif event.kind == "removed":
                self.lifetimes_s += [now - self._stored.pop(h) for h in event.hashes if h in self._stored]
            else:
                self._stored.clear()
        if self._next is not None:
            self._next(events)


class ServerTTFT:
    """A structlog processor keeping each model's last ``local.request.finished`` time to first token (the engine's
    own: queueing and prefill, without HTTP and litellm); every event is then dropped."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def __call__(self, _logger: Any, _method: str, event: dict[str, Any]) -> Any:
        if event.get("event") == "local.request.finished" and event.get("ttft_s") is not None:
            self.last[str(event.get("model_id"))] = float(event["ttft_s"])
        raise structlog.DropEvent


SERVER_TTFT = ServerTTFT()


def event_aware_available() -> bool:
    """Whether this build's Session takes a CacheLedger (issue 15's event-aware warm-ahead)."""
    return "cache_ledger" in inspect.signature(Session).parameters


def event_policy(args: argparse.Namespace) -> WarmAheadPolicy:
    """The event-aware mode's policy: top-ups scaled to this run's window (when this build has them)."""
    has_top_up = "top_up_tokens" in {f.name for f in fields(WarmAheadPolicy)}
    return WarmAheadPolicy(**({"top_up_tokens": args.top_up_tokens} if has_top_up else {}))


def eviction(args: argparse.Namespace) -> dict[str, str]:
    """The slow engine's eviction order (vLLM's LRU by default), on builds whose engine has a choice."""
    from agentkv.embedded.engine import LocalEngine

    return {"eviction_policy": args.eviction} if "eviction_policy" in inspect.signature(LocalEngine).parameters else {}


def start_servers(args: argparse.Namespace, kv_events: bool) -> tuple[LocalServer, LocalServer]:
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*"} if kv_events else None
    fast = LocalServer.from_size(args.fast_size, window=args.fast_window, model_id="econ-fast")
    slow = LocalServer.from_size(args.slow_size, window=args.slow_window, model_id="econ-slow", seed=1,
                                 kv_events_config=config, **eviction(args))
    return fast, slow


def backends(fast: LocalServer, slow: LocalServer, kv_events: bool) -> tuple[Backend, Backend]:
    extra = dict(kv_events=slow.kv_events.endpoint, kv_events_replay=slow.kv_events.replay_endpoint) if kv_events else {}
    return (Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base, name="fast"),
            Backend(f"hosted_vllm/{slow.model_id}", api_base=slow.api_base, name="slow", **extra))


def ttft(session: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> float:
    """Send one streamed turn through the Session; seconds until the first chunk that carries output."""
    start, first = time.perf_counter(), None
    for chunk in session.completion(messages=messages, tools=tools, max_tokens=2, stream=True,
                                    stream_options={"include_usage": True}):
        choices = getattr(chunk, "choices", None) or []
        if first is None and any(getattr(c.delta, "content", None) or c.finish_reason for c in choices):
            first = time.perf_counter() - start
    return first or (time.perf_counter() - start)


def warm_up(*servers: LocalServer) -> None:
    """One unrelated streamed request per server, so first-call costs (litellm's import, kernels) stay out of the
    first mode's figures; then the caches are emptied."""
    from agentkv._support.env import import_litellm

    litellm = import_litellm()
    litellm.suppress_debug_info = True
    for server in servers:
        for _ in litellm.completion(model=f"hosted_vllm/{server.model_id}", api_base=server.api_base, max_tokens=2,
                                    messages=[{"role": "user", "content": "kernel warm-up " * 300}], stream=True):
            pass
        server.engine.reset_prefix_cache()


def slow_prefill(slow: LocalServer) -> int:
    stats = slow.engine.stats()
    return stats.prefix_cache_queries - stats.prefix_cache_hits


class Mode:
    """One mode: its own fast and slow servers (so modes never share a cache), guards, ledger and live sessions.

    ``servers`` are borrowed when given (tests), else started and stopped by :meth:`open` and :meth:`close`."""

    def __init__(self, name: str, policy: WarmAheadPolicy, args: argparse.Namespace, clock: FakeClock, *,
                 ledger: bool = False, servers: tuple[LocalServer, LocalServer] | None = None) -> None:
        self.name, self.policy, self.args, self.clock, self.ledger = name, policy, args, clock, ledger
        self._owned = servers is None
        self.fast, self.slow = servers or start_servers(args, kv_events=ledger)
        self.result = ModeResult(name)
        self.live: dict[int, tuple[Session, ScriptedAgent, list[dict[str, Any]]]] = {}
        self.cooldowns = CooldownMap(maxsize=4096, ttl_s=policy.cooldown_s, timer=clock)
        self.in_flight = InFlightLimit(64)
        self._extra: dict[str, Any] = {}
        self._cache_ledger: Any = None
        self._probe: LifetimeProbe | None = None

    def open(self, plans: list[Plan]) -> Mode:
        if self._owned:
            self.fast.__enter__()
            self.slow.__enter__()
            self.slow.engine.prefix_cache.resize(self.args.cache_tokens * self.slow.engine.kv_bytes_per_token)
            warm_up(self.fast, self.slow)
        for server in (self.fast, self.slow):
            server.engine.reset_prefix_cache()
        self.fast_b, self.slow_b = backends(self.fast, self.slow, self.ledger)
        if self.ledger:
            from agentkv.cache_ledger import CacheLedger

            self._cache_ledger = CacheLedger([self.slow_b]).start()
            self._extra["cache_ledger"] = self._cache_ledger
        self._probe = LifetimeProbe(self.slow.engine.prefix_cache, self.clock)
        self.result.sessions = [SessionResult() for _ in plans]
        return self

    def close(self) -> None:
        if self._probe is not None:
            self._probe.remove(self.slow.engine.prefix_cache)
            self.result.lifetimes_s = self._probe.lifetimes_s
        if self._cache_ledger is not None:
            self._cache_ledger.stop()
        if self._owned:
            self.slow.__exit__(None, None, None)
            self.fast.__exit__(None, None, None)
        sessions = self.result.sessions
        self.result.sim_s = self.clock()
        self.result.slow_new_prefill = sum(s.warm_prefill for s in sessions) + sum(
            s.escalation_input - s.escalation_cached for s in sessions if s.escalated_turn is not None)

    def turn(self, plan: Plan, turn: int) -> bool:
        """Play ``plan``'s turn ``turn`` in this mode; True when the session ends (escalated or its last turn)."""
        started = time.perf_counter()
        if plan.index not in self.live:
            session = Session(self.fast_b, self.slow_b, tenant=f"{self.name}-{plan.index}", session_id=f"s{plan.index}",
                              cache_salt_secret=SECRET, cooldowns=self.cooldowns, in_flight=self.in_flight,
                              clock=self.clock, warm_ahead=self.policy,
                              routing=RoutePolicy(output_floor=self.args.output_floor, min_output=16), **self._extra)
            agent = ScriptedAgent(seed=plan.index)
            self.live[plan.index] = (session, agent, agent.opening())
        session, agent, messages = self.live[plan.index]
        out = self.result.sessions[plan.index]
        ended = _turn(session, messages, TOOLS[: self.args.tools], out, self.slow, turn) or turn + 1 >= plan.turns
        if ended:
            self.result.stats = _merged(self.result.stats, session.stats())
            out.warms = sum(session.stats().get(k, 0) for k in WARMS_SENT)
            del self.live[plan.index]
        else:
            self.live[plan.index] = (session, agent, messages + agent.next_turn(rows=plan.rows[turn]))
        self.result.wall_s += time.perf_counter() - started
        return ended


def play(modes: list[Mode], plans: list[Plan]) -> list[ModeResult]:
    """The population through every mode in lockstep: each turn is played by every mode back to back, so their
    times to first token are measured under the same machine load; think time goes to the shared clock."""
    clock = modes[0].clock
    for mode in modes:
        mode.open(plans)
    queue = [(p.arrival_s, p.index, 0) for p in plans]
    heapq.heapify(queue)
    done: set[tuple[str, int]] = set()
    try:
        while queue:
            at, index, turn = heapq.heappop(queue)
            clock.advance(at - clock())
            for mode in modes:
                if (mode.name, index) not in done and mode.turn(plans[index], turn):
                    done.add((mode.name, index))
            if any((mode.name, index) not in done for mode in modes):
                heapq.heappush(queue, (at + plans[index].think_s[turn], index, turn + 1))
    finally:
        for mode in modes:
            mode.close()
    return [mode.result for mode in modes]


def _turn(session: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]], out: SessionResult,
          slow: LocalServer, turn: int) -> bool:
    """One turn, then its warm (if any) finishes during the think time; True when the turn escalated."""
    before = slow_prefill(slow)
    seconds = ttft(session, messages, tools)
    session.drain_warms(120)
    entry = session.ledger[-1]
    if entry.backend == "slow":
        out.escalated_turn, out.escalation_ttft_s = turn, seconds
        out.escalation_server_ttft_s = SERVER_TTFT.last.get(slow.model_id, 0.0)
        out.escalation_input, out.escalation_cached = entry.input_tokens, entry.cached_tokens or 0
        return True
    out.warm_prefill += slow_prefill(slow) - before  # on a fast turn, all the slow server does is warms
    return False


def _merged(total: dict[str, int], more: dict[str, Any]) -> dict[str, int]:
    merged = dict(total)
    for key, value in more.items():
        if isinstance(value, int) and key.startswith("warm_"):
            merged[key] = merged.get(key, 0) + value
    return merged


def observed_lifetime_s(run: ModeResult, cache_tokens: int) -> tuple[float, float]:
    """The slow cache's expected block lifetime, two ways: the median time evicted blocks were held (stored to
    removed, as a KV-event subscriber sees it; inf without evictions), and capacity over the mean rate of new
    prefill (what LRU evicts; it under-states a bursty load's eviction rate)."""
    rate = run.slow_new_prefill / max(run.sim_s, 1.0)
    by_rate = cache_tokens / rate if rate > 0 else math.inf
    return (statistics.median(run.lifetimes_s) if run.lifetimes_s else math.inf), by_rate


def report(runs: list[ModeResult], cold: ModeResult) -> None:
    """One row per mode, side by side; TTFTs are the escalated turns' means, end to end (and the engine's own)."""
    escalated = [i for i, s in enumerate(cold.sessions) if s.escalated_turn is not None]
    print(f"{len(escalated)} of {len(cold.sessions)} sessions escalate; TTFT: end to end through litellm "
          f"(in brackets: the slow engine's own, queueing + prefill); prefill saved: escalation tokens found cached "
          f"per 1K warm prefill tokens (load-independent)")
    print(f"{'mode':16s} {'warms':>5s} {'warm prefill':>12s} {'unread':>6s} {'found warm':>10s} "
          f"{'escal. TTFT ms':>16s} {'saved ms / 1K warm':>19s} {'prefill saved / 1K':>18s}  skips")
    for run in [cold, *runs]:
        prefill = sum(s.warm_prefill for s in run.sessions)
        unread = prefill - sum(s.warm_tokens_read for s in run.sessions)
        found = sum(run.sessions[i].escalation_cached >= 0.5 * run.sessions[i].escalation_input for i in escalated)
        ttft, server = (_mean([getattr(run.sessions[i], f) for i in escalated])
                        for f in ("escalation_ttft_s", "escalation_server_ttft_s"))
        saved = [sum(getattr(cold.sessions[i], f) - getattr(run.sessions[i], f) for i in escalated) * 1e6 / prefill
                 if prefill else None for f in ("escalation_ttft_s", "escalation_server_ttft_s")]
        per_k = "-" if saved[0] is None else f"{saved[0]:.1f} ({saved[1]:.1f})"
        avoided = sum(run.sessions[i].escalation_cached - cold.sessions[i].escalation_cached for i in escalated)
        per_k_tokens = f"{avoided * 1000 / prefill:.0f}" if prefill else "-"
        skips = " ".join(f"{k.removeprefix('warm_skipped_')}={v}" for k, v in sorted(run.stats.items())
                         if k.startswith("warm_skipped_") and k != "warm_skipped_disabled" and v)
        print(f"{run.name:16s} {sum(s.warms for s in run.sessions):5d} {prefill:12d} {unread / max(prefill, 1):6.0%} "
              f"{f'{found}/{len(escalated)}':>10s} {f'{ttft * 1000:.0f} ({server * 1000:.0f})':>16s} {per_k:>19s} "
              f"{per_k_tokens:>18s}  {skips or '-'}")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--sessions", type=int, default=48, help="sessions in the population")
    add("--seed", type=int, default=7)
    add("--fast-size", default="tiny")
    add("--slow-size", default="small")
    add("--fast-window", type=int, default=2048)
    add("--slow-window", type=int, default=8192)
    add("--output-floor", type=int, default=256)
    add("--tools", type=int, default=8, help="tool schemas sent with every turn")
    add("--cache-tokens", type=int, default=8192, help="the slow server's prefix cache, in tokens")
    add("--lifetime-s", type=float, default=None,
        help="the gate's cache_lifetime_s (default: measured from the cooldown-only run's eviction rate)")
    add("--eviction", default="lru", help="the slow engine's eviction order: lru (vLLM's) or fair (per tenant)")
    add("--top-up-tokens", type=int, default=256, help="event-aware mode: WarmAheadPolicy.top_up_tokens")
    add("--gate-lifetimes", type=float, nargs="*", default=[],
        help="extra rows: the gate with these cache_lifetime_s settings (its sensitivity)")
    add("--min-turns", type=float, default=2.0, help="Pareto scale: the shortest session, in turns")
    add("--alpha", type=float, default=1.1, help="Pareto shape of the turn counts (smaller: heavier tail)")
    add("--max-turns", type=int, default=40)
    add("--think-median-s", type=float, default=60.0)
    add("--think-sigma", type=float, default=1.0, help="lognormal sigma of the per-session pace")
    add("--rows-median", type=float, default=3.0, help="median tool output rows per turn (~70 tokens a row)")
    add("--arrivals-s", type=float, default=600.0, help="sessions start uniformly over this many seconds")
    return parser.parse_args()


def main() -> None:
    args = parse()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO), processors=[SERVER_TTFT])
    plans = population(args)
    aware = event_aware_available()
    print(f"{args.sessions} sessions (seed {args.seed}): turns {sorted(p.turns for p in plans)}")
    print(f"fast {args.fast_size}/{args.fast_window}, slow {args.slow_size}/{args.slow_window}, "
          f"slow prefix cache {args.cache_tokens} tokens ({args.eviction}); every mode on its own pair of servers")
    started = time.perf_counter()
    calibration = play([Mode("calibration", WarmAheadPolicy(), args, FakeClock(0.0))], plans)[0]
    held, by_rate = observed_lifetime_s(calibration, args.cache_tokens)
    lifetime = args.lifetime_s or held
    print(f"slow cache lifetime, cooldown-only calibration run: evicted blocks held median {held:.0f} s "
          f"(n={len(calibration.lifetimes_s)}); capacity / mean new-prefill rate {by_rate:.0f} s; "
          f"the gate's cache_lifetime_s = {lifetime:.0f} s" + (" (--lifetime-s)" if args.lifetime_s else ""))
    if not aware:
        print("event-aware: not available on this build (Session has no cache_ledger= parameter)")
    gate = WarmAheadPolicy(break_even=True, cache_lifetime_s=lifetime)
    specs: list[tuple[str, WarmAheadPolicy, bool]] = [
        ("cold", WarmAheadPolicy(enabled=False), False), ("cooldown-only", WarmAheadPolicy(), False),
        *([("event-aware", event_policy(args), True)] if aware else []),
        ("break-even gate", gate, False),
        *([("event-aware+gate", replace(event_policy(args), break_even=True, cache_lifetime_s=lifetime), True)]
          if aware else []),
        *[(f"gate @{other:.0f}s", replace(gate, cache_lifetime_s=other), False) for other in args.gate_lifetimes],
    ]
    clock = FakeClock(0.0)
    cold, *runs = play([Mode(name, policy, args, clock, ledger=ledger) for name, policy, ledger in specs], plans)
    report(runs, cold)
    print(f"wall {time.perf_counter() - started:.0f} s: " + ", ".join(f"{r.name} {r.wall_s:.0f} s" for r in [cold, *runs]))


if __name__ == "__main__":
    main()
