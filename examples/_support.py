"""What the examples share: arguments, quiet logs, the embedded servers, a scripted model, a ledger printer.

The embedded models have random weights, so their text is meaningless. The examples drive the agent
with a script instead: every request still goes through litellm and HTTP to a real engine (real
token counts, real windows, real prefix-cache hits); only the assistant's *text* is replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agentkv import Backend  # noqa: E402 (after the environment is set)
from agentkv.testing import ScriptedReplies  # noqa: E402 (after the environment is set)
from agentkv.testing.servers import embedded_servers  # noqa: E402


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny models and few turns (for tests)")
    return parser.parse_args()


def quiet_logs() -> None:
    """Only agentkv's warnings: the examples print their own summary."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger("LiteLLM").setLevel(logging.ERROR)


class Servers(NamedTuple):
    """The two backends and the embedded servers behind them."""

    fast: Backend
    slow: Backend
    fast_server: Any
    slow_server: Any

    def warm_requests(self) -> int:
        """How many one-token warm-ahead requests the slow server received."""
        return sum(1 for r in self.slow_server.requests
                   if r.path == "/v1/chat/completions" and (r.body or {}).get("max_tokens") == 1)


@contextlib.contextmanager
def servers(quick: bool) -> Iterator[Servers]:
    """Two embedded servers (fast: 2048-token window, slow: 16384) and a Backend for each."""
    sizes = ("tiny", "tiny") if quick else ("small", "large")
    print(f"starting two embedded vLLM-compatible servers ({sizes[0]} and {sizes[1]} random-weight models)...")
    with embedded_servers(*sizes) as (fast, slow):
        yield Servers(Backend(f"hosted_vllm/{fast.model_id}", api_base=fast.api_base, name="fast"),
                      Backend(f"hosted_vllm/{slow.model_id}", api_base=slow.api_base, name="slow"), fast, slow)


def tool_call(name: str, **arguments: Any) -> list[tuple[str, str]]:
    """One scripted assistant turn calling ``name``."""
    return [(name, json.dumps(arguments))]


ScriptedModel = ScriptedReplies
"""Sends each request for real, then swaps in the script's next turn (see :class:`agentkv.testing.ScriptedReplies`)."""


def print_ledger(session: Any) -> None:
    """One line per ledger row: tokens, share of tool schemas, where it went and why, warm-ahead, cached tokens."""
    print(f"{'turn':>4} {'tokens':>6} {'tools':>5}  {'backend':<7} {'reason':<10} {'warm':<16} cached")
    for row in session.ledger:
        print(f"{row.turn:>4} {row.input_tokens:>6} {row.tools_share:>5.0%}  {row.backend:<7} {row.reason:<10} "
              f"{row.warm or '-':<16} {row.cached_tokens if row.cached_tokens is not None else '-'}")


def print_stats(session: Any) -> None:
    """The non-zero counters of the Session's stats."""
    stats = session.stats()
    shown = {k: v for k, v in stats.items() if v and k != "requests"}
    print(f"requests per backend: {stats['requests']}; {shown}")


def storage_logs(host: str, lines: int) -> str:
    """A deterministic tool result of about 35 tokens per line."""
    return "\n".join(f"{host} 2026-11-29T{i % 24:02d}:00:00Z osd.{i % 7} slow request id={i:04d} blocked for "
                     f"{30 + i % 9}s on sdb" for i in range(lines))


def lookup_script(steps: int, final: str) -> list[Any]:
    """``steps`` scripted turns calling ``lookup`` with a new host each, then ``final``."""
    return [tool_call("lookup", host=f"osd-{i:02d}") for i in range(steps)] + [final]


def escalation_summary(session: Any, env: Servers) -> str:
    """Where the conversation escalated and how much of it the slow server found cached (its own usage)."""
    row = next((r for r in session.ledger if r.backend == "slow"), None)
    if row is None:
        return "never escalated"
    return (f"escalated to slow at turn {row.turn} with {row.input_tokens} tokens, {row.cached_tokens} of them "
            f"already cached by {env.warm_requests()} warm")
