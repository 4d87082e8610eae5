"""The warm-prefix check at the escalation: a diagnostic, run in the background, never on the request path.

It compares what warm-ahead warmed with what the escalation sent (rendered tokens, from the slow backend's
counter) and warns when the warm no longer prefixes it (``warm_prefix_broken``).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from agentkv.events import emit
from agentkv.prefix import PrefixReport, build_report, explain_divergence
from agentkv.stats import SessionStats
from agentkv.tokens import Payload, TokenCounter
from agentkv.warm.sender import BackgroundJobs

__all__ = ["acheck_warm_prefix", "check_warm_prefix", "prefix_report", "schedule_warm_prefix_check"]


def prefix_report(previous: Payload, current: Payload, prev_ids: tuple[list[int], bool],
                  ids: tuple[list[int], bool]) -> PrefixReport:
    """Compare two payloads' rendered token ids (each with whether it is exact) and explain the split."""
    divergence = explain_divergence(previous.messages or (), previous.tools, current.messages or (), current.tools)
    return build_report(prev_ids[0], ids[0], divergence, exact=prev_ids[1] and ids[1])


def check_warm_prefix(counter: TokenCounter, warmed: Payload, sent: Payload, stats: SessionStats,
                      session_id: str) -> None:
    """Warn when the warmed prompt is not a prefix of the escalated one (run off the request path)."""
    report = prefix_report(warmed, sent, counter.token_ids(warmed, add_generation_prompt=False),
                           counter.token_ids(sent))
    _judge(report, stats, session_id)


async def acheck_warm_prefix(counter: TokenCounter, warmed: Payload, sent: Payload, stats: SessionStats,
                             session_id: str) -> None:
    """:func:`check_warm_prefix` over async HTTP (run as a background task)."""
    report = prefix_report(warmed, sent, await counter.atoken_ids(warmed, add_generation_prompt=False),
                           await counter.atoken_ids(sent))
    _judge(report, stats, session_id)


def schedule_warm_prefix_check(jobs: BackgroundJobs, counter: TokenCounter, warmed: Payload, sent: Payload,
                               stats: SessionStats, session_id: str, *, asynchronous: bool) -> None:
    """Run the warm-prefix check in the background: a task on the running loop, or a pool thread."""
    if asynchronous:
        jobs.task(_quietly(acheck_warm_prefix(counter, warmed, sent, stats, session_id)), 60.0)
    else:
        jobs.thread(lambda: _quietly_sync(check_warm_prefix, counter, warmed, sent, stats, session_id))


async def _quietly(work: Awaitable[None]) -> None:
    """Await a diagnostic; its failure is logged, never raised into anyone."""
    try:
        await work
    except Exception as exc:
        emit("diagnostic_failed", level="debug", error=type(exc).__name__)


def _quietly_sync(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # a diagnostic never raises into anyone
        emit("diagnostic_failed", level="debug", error=type(exc).__name__)


def _judge(report: PrefixReport, stats: SessionStats, session_id: str) -> None:
    if not report.intact:
        stats.add("warm_prefix_broken")
        emit("warm_prefix_broken", level="warning", reason=report.reason, reusable_tokens=report.reusable_tokens,
             warmed_tokens=report.previous_tokens, session=session_id)
