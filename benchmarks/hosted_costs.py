"""What warm-ahead costs per escalation when the slow model is hosted, per provider, at 8K, 32K and 100K tokens, with
and without the cost gate: measured through litellm's real provider code against the provider fakes
(:mod:`agentkv.testing.providers`), priced from litellm's cost map.

Per provider and size N, a population of chat conversations runs through a Session whose fast model (the same
provider's small one, on the same fake, window N) escalates to its big one: ``--escalating`` of them grow past N
(their escalation and one more slow turn), the rest stop at 90% of N after the warm at 60% fired. Each population runs
three times side by side: no warm-ahead, warm-ahead, and cost-aware warm-ahead (``max_premium=0.25``). Printed per row:

- esc: the conversations that escalated (with no count endpoint, OpenAI's estimates escalate a conversation that
  stops at 90% of N too: an estimate is biased toward never sending a doomed request);
- warm $: what the warms cost (their cache writes, their output token; Gemini explicit: its storage to close);
- esc saved $: what the escalations' cache reads saved against paying those tokens uncached;
- slow $ per escalation: the slow model's whole bill (warms, escalations, later slow turns) over the escalations,
  for each mode; and the warm's premium: (warm mode − no warm) over no warm.

    python benchmarks/hosted_costs.py          # 3 providers (+ Gemini explicit), 8K/32K/100K; 4 of 10, then 10 of 10 escalate
    python benchmarks/hosted_costs.py --sizes 8000 --escalating 10 --population 10
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from agentkv import Backend, Session, WarmAheadPolicy  # noqa: E402
from agentkv.testing.providers.anthropic import FakeAnthropic  # noqa: E402
from agentkv.testing.providers.gemini import FakeGemini  # noqa: E402
from agentkv.testing.providers.openai import CONTEXT_WINDOWS, FakeOpenAI  # noqa: E402
from agentkv.testing import capture_events  # noqa: E402


@dataclass(frozen=True)
class Provider:
    name: str
    fake: Callable[[int], Any]  # window -> a fake whose fast model has that window
    fast: str
    slow: str
    base: Callable[[Any], str]
    explicit: bool = False


PROVIDERS = [
    Provider("anthropic sonnet-4.5", lambda n: FakeAnthropic(windows={"claude-haiku-4-5": n}),
             "anthropic/claude-haiku-4-5", "anthropic/claude-sonnet-4-5", lambda f: f.url),
    Provider("openai gpt-5.6", lambda n: FakeOpenAI(context_windows={**CONTEXT_WINDOWS, "gpt-5.4-mini": n}),
             "openai/gpt-5.4-mini", "openai/gpt-5.6", lambda f: f.url + "/v1"),
    Provider("gemini 2.5-pro implicit", lambda n: FakeGemini(windows={"gemini-2.5-pro": 1048576, "gemini-2.5-flash": n}),
             "gemini/gemini-2.5-flash", "gemini/gemini-2.5-pro", lambda f: f.url),
    Provider("gemini 2.5-pro explicit", lambda n: FakeGemini(windows={"gemini-2.5-pro": 1048576, "gemini-2.5-flash": n}),
             "gemini/gemini-2.5-flash", "gemini/gemini-2.5-pro", lambda f: f.url, explicit=True),
]
MODES = ("no warm", "warm", "cost gate")
KEY = "sk-test"  # the OpenAI fake's default key; the others take any


_WORDS = ("the checkout service latency rose again after the deploy while the cache hit rate fell and the "
          "database queue grew longer than any alert had warned about before").split()


def conversation(size: int, stop: float, seed: int) -> list[list[dict[str, Any]]]:
    """A chat's requests from 45% of ``size`` tokens to ``stop`` times ``size``, in steps of about 5% of it (common
    English words: one token each for cl100k and for the fakes alike)."""
    step = max(20, size // 20)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"Analyst {seed}. " + " ".join(_WORDS * 4)}]
    history, tokens, turn = [], 80, 0
    while tokens < stop * size:
        text = " ".join(_WORDS[(seed + turn + i) % len(_WORDS)] for i in range(step))
        msgs = msgs + [{"role": "user", "content": f"Question {turn}: {text}"}]
        tokens += step + 12
        if tokens >= 0.45 * size:
            history.append(copy.deepcopy(msgs))
        msgs = msgs + [{"role": "assistant", "content": f"Answer {turn}: noted."}]
        turn += 1
    return history


def run_mode(provider: Provider, size: int, mode: str, population: int, escalating: int) -> dict[str, float]:
    """One population through one mode: the slow model's dollars and the escalations."""
    totals = {"warm": 0.0, "saved": 0.0, "slow": 0.0, "escalations": 0, "warms": 0}
    label = f"slow-{uuid.uuid4().hex[:8]}"  # a fresh escalation tally for the cost gate
    policy = WarmAheadPolicy(enabled=mode != "no warm", cost_aware=mode == "cost gate", max_premium=0.25)
    with ExitStack() as stack:
        fake = stack.enter_context(provider.fake(size))
        base = provider.base(fake)
        for i in range(population):
            stop = 1.12 if i < escalating else 0.9
            kind = provider.fast.split("/")[0]  # an api_base in front of OpenAI is declared, as a proxy would be
            fast = Backend(provider.fast, api_base=base, api_key=KEY, name="fast", window=size, provider=kind)
            slow = Backend(provider.slow, api_base=base, api_key=KEY, name=label, explicit_cache=provider.explicit,
                           provider=kind)
            with capture_events() as events:
                session = Session(fast, slow, warm_ahead=policy, session_id=f"bench-{uuid.uuid4()}")
                for msgs in conversation(size, stop, i):
                    session.completion(messages=msgs, max_tokens=8)
                    session.drain_warms(60)
                session.close()
                session.drain_warms(60)
            stats = session.stats()
            totals["warm"] += stats["warm_cost_usd"]
            totals["saved"] += stats["escalation_saved_usd"]
            totals["warms"] += stats["warm_completed"]
            totals["escalations"] += stats["escalations"]
            totals["slow"] += sum(e.get("cost_usd") or 0.0 for e in events
                                  if e["event"] in ("warm_cost", "hosted_cache") and e.get("backend") == label)
            totals["slow"] += stats["warm_cost_usd"] - sum(e.get("cost_usd") or 0.0 for e in events
                                                            if e["event"] == "warm_cost")  # explicit storage
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8000,32000,100000")
    parser.add_argument("--population", type=int, default=10)
    parser.add_argument("--escalating", default="4,10", help="how many of the population escalate (one table each)")
    parser.add_argument("--providers", default="", help="comma-separated name prefixes (default: all)")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    sizes = [int(s) for s in args.sizes.split(",")]
    chosen = [p for p in PROVIDERS if not args.providers or any(p.name.startswith(x) for x in args.providers.split(","))]
    for escalating in [int(n) for n in args.escalating.split(",")]:
        table(chosen, sizes, args.population, escalating)


def table(chosen: list[Provider], sizes: list[int], population: int, escalating: int) -> None:
    print(f"\n{escalating} of {population} conversations escalate; USD per escalation on the slow model")
    print(f"{'provider':26} {'size':>7} | {'esc':>3} {'warms':>5} {'warm $':>9} {'esc saved $':>11} | "
          + " | ".join(f"{m:>10}" for m in MODES) + " | premium | gate warms")
    for provider in chosen:
        for size in sizes:
            results = {mode: run_mode(provider, size, mode, population, escalating) for mode in MODES}
            per = {m: r["slow"] / max(1, r["escalations"]) for m, r in results.items()}
            warm = results["warm"]
            premium = (per["warm"] - per["no warm"]) / per["no warm"] if per["no warm"] else float("nan")
            print(f"{provider.name:26} {size:>7} | {warm['escalations']:>3} {warm['warms']:>5} {warm['warm']:>9.4f} "
                  f"{warm['saved']:>11.4f} | "
                  + " | ".join(f"{per[m]:>10.4f}" for m in MODES) + f" | {premium:+7.1%} | "
                  + f"{results['cost gate']['warms']:>10}", flush=True)

if __name__ == "__main__":
    main()
