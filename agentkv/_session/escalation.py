"""What happens at the escalation besides the request: the KV handoff, and the warm-prefix check.

The warm-prefix check compares what warm-ahead warmed with what the escalation sent (rendered
tokens, from the slow backend's counter) and warns when the warm no longer prefixes it. It is a
diagnostic: the driver runs it in the background, never on the request path.

KV handoff at escalation, for Sessions whose backends are in-process embedded engines.

At the move from fast to slow, a configured mapper (``Session(..., handoff="ridge", mapper=PATH)``)
takes the fast engine's cached KV for the conversation's prefix, maps it, and installs it in the slow
engine's prefix cache under the slow engine's own block hashes; the slow engine then prefills only the
unmapped tail. Anything that stops that (engines not in this process, a mapper below the quality gate,
a signature mismatch) falls back to ``replay`` -- the slow engine prefills the tokens itself -- with a
logged reason. A handoff never fails the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from agentkv.backends import Backend
from agentkv.errors import ConfigurationError
from agentkv.events import emit
from agentkv.handoff.plan import REPLAY
from agentkv.prefix import PrefixReport, build_report, explain_divergence
from agentkv.stats import SessionStats
from agentkv.tokens import Payload, TokenCounter
from agentkv.warm.sender import BackgroundJobs


@dataclass(frozen=True)
class HandoffOutcome:
    """What happened at one escalation: tokens whose KV was mapped in, the backend, and why."""

    mapped_tokens: int
    backend: str
    reason: str
    fallback: bool = False


class Handoff:
    """A Session's handoff configuration and the mapper it loads on first use.

        Handoff("ridge", mapper="mappers/small-to-large", min_attention_cosine=0.95)
    """

    def __init__(self, backend: str = REPLAY, mapper: Any = None, *, min_attention_cosine: float | None = None) -> None:
        from agentkv.handoff import DEFAULT_MIN_ATTENTION_COSINE, available_mappers

        if backend not in available_mappers():
            raise ConfigurationError(f"handoff={backend!r} is not a registered KV mapper; have {available_mappers()}")
        if backend not in (REPLAY, "identity") and mapper is None:
            raise ConfigurationError(f"handoff={backend!r} needs mapper= (a saved mapper directory or a KVMapper)")
        self.backend = backend
        self._spec = mapper
        self._mapper: Any = None
        self.min_attention_cosine = DEFAULT_MIN_ATTENTION_COSINE if min_attention_cosine is None else min_attention_cosine

    @property
    def active(self) -> bool:
        """False for ``replay``: nothing to do at escalation."""
        return self.backend != REPLAY

    def at_escalation(self, fast: Backend, slow: Backend, payload: Payload, cache_salt: str | None) -> HandoffOutcome:
        """Map the fast engine's cached prefix into the slow engine, or say why it replays instead."""
        from agentkv.local.server import engine_at

        engines = engine_at(fast.api_base), engine_at(slow.api_base)
        if None in engines:
            return self._fallback("fast and slow are not both embedded engines in this process")
        try:
            return self._map(engines[0], engines[1], payload, cache_salt)
        except Exception as error:  # a handoff never fails the request: the slow engine prefills instead
            return self._fallback(f"{type(error).__name__}: {error}")

    def _map(self, source: Any, target: Any, payload: Payload, cache_salt: str | None) -> HandoffOutcome:
        from agentkv.handoff import choose_handoff, handoff_prefix, log_plan
        from agentkv.handoff.engines import engine_signature

        plan = choose_handoff(self._load(source, target), self.min_attention_cosine,
                              source=engine_signature(source), target=engine_signature(target))
        log_plan(plan)
        if plan.replay:
            return HandoffOutcome(0, REPLAY, plan.reason, fallback=plan.fallback)
        token_ids = source.tokenize_chat(list(payload.messages or ()), list(payload.tools or ()) or None,
                                         payload.tool_choice, chat_template_kwargs=payload.template_kwargs)
        result = handoff_prefix(source, target, token_ids, plan.mapper, cache_salt=cache_salt)
        return HandoffOutcome(result.mapped_tokens, result.backend, result.reason, fallback=result.replayed)

    def _load(self, source: Any, target: Any) -> Any:
        if self._mapper is None:
            from agentkv.handoff import load_mapper

            spec = self._spec if self._spec is not None else self.backend
            self._mapper = load_mapper(spec, source=source.model, target=target.model) \
                if isinstance(spec, (str, Path)) and Path(spec).is_dir() else spec
        return self._mapper

    def _fallback(self, reason: str) -> HandoffOutcome:
        emit("handoff.fallback", level="warning", backend=REPLAY, configured=self.backend, reason=reason)
        return HandoffOutcome(0, REPLAY, reason, fallback=True)


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
