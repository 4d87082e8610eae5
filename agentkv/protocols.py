"""The typed seams between agentkv's parts: what a completion client and a Session look like.

Integrations, the ReAct helper and the decorator take anything of these shapes, so a test (or a
user) can hand them a fake without subclassing anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agentkv.backends import Backend
    from agentkv.routing import RouteDecision
    from agentkv.stats import LedgerEntry
    from agentkv.tokens import TokenCount

__all__ = ["CompletionClient", "Observation", "SessionLike"]


@dataclass(frozen=True)
class Observation:
    """A request accounted by :meth:`Session.observe`: its ledger turn, its count, the route agentkv
    would have chosen (``fits`` is False when the fast backend cannot take it as it is), and the fast
    (``window``) and slow (``slow_window``) windows it was decided with."""

    turn: int
    count: TokenCount
    decision: RouteDecision | None
    window: int | None
    warm: str
    slow_window: int | None = None

    @property
    def fits(self) -> bool:
        """True when the fast backend can take the request as sent (a declined reroute has a note)."""
        return self.decision is not None and self.decision.reason == "fits" and not self.decision.note


@runtime_checkable
class CompletionClient(Protocol):
    """Anything with litellm's ``completion``/``acompletion`` (litellm itself by default)."""

    def completion(self, **kwargs: Any) -> Any: ...

    async def acompletion(self, **kwargs: Any) -> Any: ...


class SessionLike(Protocol):
    """What integrations and the ReAct helper use of a :class:`agentkv.Session`."""

    @property
    def fast(self) -> Backend: ...

    @property
    def slow(self) -> Backend | None: ...

    @property
    def session_id(self) -> str: ...

    @property
    def tenant(self) -> str | None: ...

    @property
    def last_route(self) -> RouteDecision | None: ...

    def request_extras(self, role: str = "fast") -> dict[str, Any]: ...

    @property
    def ledger(self) -> list[LedgerEntry]: ...

    def completion(self, **kwargs: Any) -> Any: ...

    async def acompletion(self, **kwargs: Any) -> Any: ...

    def observe(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation: ...

    async def aobserve(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation: ...

    def route(self, **kwargs: Any) -> RouteDecision: ...

    async def aroute(self, **kwargs: Any) -> RouteDecision: ...

    def record_usage(self, turn: int, *, cached_tokens: int | None) -> None: ...

    def stats(self) -> dict[str, Any]: ...
