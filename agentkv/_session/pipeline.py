"""A turn's events, each one object passed through the Session's processors (as structlog passes an event through
its processors).

Each thing that happens in a turn is one :class:`TurnEvent`: its ``kind``, the attempt it happened to, and its
``data`` (sizes, names, outcomes, the answer's usage: never prompt text). :meth:`Pipeline.report` passes it through
each processor of the Session's tuple, in order (:mod:`agentkv._session.processors` holds them and registers each
where it applies). A processor is a plain function ``(parts, event) -> None``; one that fails is logged by its
error's type and the next runs: reporting never fails a turn.

    parts.report(TurnEvent("failed_over", attempt, {"error": error, "to": decision.backend}))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from agentkv.events import emit

if TYPE_CHECKING:
    from agentkv._session.attempts import Attempt

__all__ = ["Pipeline", "Processor", "TurnEvent"]


@dataclass(frozen=True)
class TurnEvent:
    """One thing that happened in a turn: ``kind`` (``routed``, ``warmed``, ``overflowed``, ``recovered``,
    ``failed_over``, ``replica_failed_over``, ``handed_off``, ``answered``, ``failed``), the ``attempt`` it happened
    to, and its ``data``."""

    kind: str
    attempt: "Attempt"
    data: Mapping[str, Any] = field(default_factory=dict)


Processor = Callable[[Any, TurnEvent], None]
"""A processor: the Session's parts and the event."""


class Pipeline:
    """The Session's processors, and :meth:`report`, which passes each event through them all."""

    def __init__(self, found: tuple[Processor, ...]) -> None:
        self.processors = found

    def report(self, s: Any, event: TurnEvent) -> None:
        """``event`` through every processor; one that fails is logged (its error's type) and the next runs."""
        for processor in self.processors:
            try:
                processor(s, event)
            except Exception as exc:  # reporting never fails a turn (nor breaks the caller's stream)
                # an answer's: what its usage teaches failed (the answer is in the caller's hands already)
                name, level = ("usage_unlearned", "error") if event.kind == "answered" else ("turn_event_unprocessed",
                                                                                             "warning")
                emit(name, level=level, kind=event.kind, processor=getattr(processor, "__name__", "?"),
                     error=type(exc).__name__, backend=event.attempt.backend.label, session=s.session_id)
