"""The warm-prefix check at the escalation: a diagnostic, run in the background, never on the request path.

It compares what warm-ahead warmed with what the escalation sent (rendered tokens, from the slow backend's
counter) and warns when the warm no longer prefixes it (``warm_prefix_broken``).
"""

from __future__ import annotations

import functools

from agentkv.events import emit
from agentkv.prefix import PrefixReport, build_report, explain_divergence
from agentkv.stats import SessionStats
from agentkv.tokens import Payload, TokenCounter
from agentkv._support.effects import Machine, Spawn

__all__ = ["check_warm_prefix", "checking_warm_prefix", "prefix_report"]


def prefix_report(previous: Payload, current: Payload, prev_ids: tuple[list[int], bool],
                  ids: tuple[list[int], bool]) -> PrefixReport:
    """Compare two payloads' rendered token ids (each with whether it is exact) and explain the split."""
    divergence = explain_divergence(previous.messages or (), previous.tools, current.messages or (), current.tools)
    return build_report(prev_ids[0], ids[0], divergence, exact=prev_ids[1] and ids[1])


def checking_warm_prefix(counter: TokenCounter, warmed: Payload, sent: Payload, stats: SessionStats,
                         session_id: str) -> Machine[None]:
    """Run :func:`check_warm_prefix` in the background (spawned: a task on the running loop, or a pool thread)."""
    yield Spawn(functools.partial(check_warm_prefix, counter, warmed, sent, stats, session_id), 60.0)


def check_warm_prefix(counter: TokenCounter, warmed: Payload, sent: Payload, stats: SessionStats,
                      session_id: str) -> Machine[None]:
    """Warn when the warmed prompt is not a prefix of the escalated one (a diagnostic: its failure is logged, never
    raised into anyone)."""
    try:
        before = yield from counter.ids(warmed, add_generation_prompt=False)
        now = yield from counter.ids(sent)
    except Exception as exc:
        emit("diagnostic_failed", level="debug", error=type(exc).__name__)
        return
    _judge(prefix_report(warmed, sent, before, now), stats, session_id)


def _judge(report: PrefixReport, stats: SessionStats, session_id: str) -> None:
    if not report.intact:
        stats.add("warm_prefix_broken")
        emit("warm_prefix_broken", level="warning", reason=report.reason, reusable_tokens=report.reusable_tokens,
             warmed_tokens=report.previous_tokens, session=session_id)
