"""One Session's view of the slow server's prefix cache, for event-aware warm-ahead (reads only, no sends).

:class:`SlowResidency` is handed the ledger, the slow backend, the tenant's salt and the slow backend's token
counter. Its methods run in a warm's background job, never on a request path: they turn a prompt into the
slow server's token ids (its ``/tokenize``, or a template declared for it), read the ledger into a
:class:`~agentkv.warm.events.Residency`, and remember the prefix this session last warmed. A warm it sent is
recorded with the ledger like any request (:meth:`SlowResidency.record_warm`): the server's ``/metrics`` count
its prefix-cache lookup, so :meth:`~agentkv.cache_ledger.CacheLedger.cross_check` must see it too.

    residency = SlowResidency(ledger, slow, cache_salt, counters[slow.label])
    ids, exact = residency.counter.token_ids(payload)
    outcome = residency.outcome(ids, exact, claimed=True, policy=policy)
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from agentkv._support.effects import Call, Machine, Wait, run
from agentkv.backends import Backend
from agentkv.events import emit
from agentkv.tokens import TokenCounter
from agentkv.warm.events import EventOutcome, Residency, decide_event_warm
from agentkv.warm.policy import WarmAheadPolicy
from agentkv.wire.usage import token_figure

if TYPE_CHECKING:
    from agentkv.cache_ledger import CacheLedger

__all__ = ["SlowResidency"]

_POLL_S = 0.01
# pool threads that may sleep waiting for a warm to show at once: the rest confirm at once (a warm not yet shown
# leaves no baseline), so a silent ledger under many sessions cannot take the 4 workers other warms need
_SETTLING = threading.BoundedSemaphore(2)


def _field(obj: Any, name: str) -> Any:
    """``obj[name]`` for a mapping (a raw POST's JSON), ``obj.name`` otherwise (litellm's objects); None if absent."""
    if obj is None:
        return None
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def usage_numbers(response: Any) -> tuple[int | None, int | None]:
    """``(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)`` of a warm's answer, None where absent."""
    usage = _field(response, "usage")
    prompt, cached = _field(usage, "prompt_tokens"), _field(_field(usage, "prompt_tokens_details"), "cached_tokens")
    return token_figure(prompt)[0], token_figure(cached)[0]  # a figure refused is absent (agentkv.wire.usage)


class SlowResidency:
    """What the slow server holds of one session's conversation, read from a ledger that follows it.

    ``busy`` is held while one of the session's event-aware jobs runs, so a burst of requests starts one
    check, not one per request. ``settle_s`` bounds the wait, after a warm, for the ledger to show its blocks
    (the events trail the response by milliseconds; the wait happens in the warm's job).
    """

    def __init__(self, ledger: CacheLedger, backend: Backend, cache_salt: str | None, counter: TokenCounter, *,
                 settle_s: float = 2.0) -> None:
        self.ledger, self.backend, self.cache_salt, self.counter = ledger, backend, cache_salt, counter
        self.settle_s = settle_s
        self.busy = threading.Lock()
        self._lock = threading.Lock()
        self._warmed: tuple[list[int], int] | None = None  # the warmed prefix's ids, and how much of it was held

    def held(self, ids: Sequence[int]) -> int:
        """Leading tokens of ``ids`` the slow server holds for this salt (full blocks), right now."""
        return self.ledger.held_tokens(self.backend, ids, self.cache_salt)

    def residency(self, ids: Sequence[int]) -> Residency:
        """The ledger's numbers for a prompt of ``ids`` and for the prefix this session last warmed."""
        with self._lock:
            warmed = self._warmed
        if warmed is None:
            return Residency(len(ids), self.held(ids))
        return Residency(len(ids), self.held(ids), warmed[1], self.held(warmed[0]))

    def outcome(self, ids: Sequence[int], exact: bool, *, claimed: bool, policy: WarmAheadPolicy) -> EventOutcome:
        """The event-aware outcome; without the server's exact ids, before the ledger has seen any block from the
        server (no events arriving), or once the ledger is stopped (its tree is stale), the plain guards decide (fire
        if claimed)."""
        if not exact or not self.ledger.live(self.backend) or self.ledger.block_size(self.backend) is None:
            emit("warm_residency_unknown", level="debug", backend=self.backend.label, tokens=len(ids))
            return "fire" if claimed else "cooldown"
        return decide_event_warm(self.residency(ids), claimed=claimed, policy=policy)

    def record_warm(self, ids: Sequence[int], exact: bool, sent_at: float, response: Any) -> None:
        """Record a sent warm with the ledger as the Session records a request: the ledger's prediction as of
        ``sent_at`` (the publishers' ``time.time()`` before the send) against the ``cached_tokens`` it reported, and
        its prompt (``usage.prompt_tokens``) toward the hit rate. Not recorded, like a request, when the prompt's
        exact ids, a live ledger or the reported ``cached_tokens`` are missing. Never raises."""
        try:
            prompt_tokens, cached = usage_numbers(response)
            if not exact or cached is None or not self.ledger.live(self.backend):
                emit("warm_unrecorded", level="debug", backend=self.backend.label, exact=exact,
                     reported=cached is not None)
                return
            predicted = self.ledger.resident_tokens(self.backend, ids, self.cache_salt, as_of=sent_at)
            self.ledger.record(self.backend, predicted, cached, prompt_tokens=prompt_tokens or len(ids))
        except Exception as exc:  # a warm's bookkeeping never raises into anyone
            emit("warm_record_failed", level="debug", error=type(exc).__name__)

    def remember(self, ids: list[int]) -> None:
        """``ids`` is now the session's warmed prefix, held as far as the ledger shows right now."""
        with self._lock:
            self._warmed = (ids, self.held(ids))

    def _settled(self, ids: Sequence[int]) -> bool:
        size = self.ledger.block_size(self.backend)
        return size is not None and self.held(ids) >= len(ids) // size * size

    def _confirmed(self, ids: list[int], settled: bool) -> None:
        """Remember a sent warm; one the ledger never showed leaves no baseline (the cooldown decides until the next
        claimed warm shows), so a stale or silent ledger cannot make every later turn a top-up or a re-warm."""
        if settled:
            self.remember(ids)
            return
        emit("warm_unconfirmed", level="debug", backend=self.backend.label, tokens=len(ids))
        with self._lock:
            self._warmed = (ids, 0)

    def settle(self, ids: list[int]) -> None:
        """Wait (up to ``settle_s``) for the ledger to show a sent warm's blocks, then remember."""
        run(self.settling(ids))

    def settling(self, ids: list[int]) -> Machine[None]:
        """:meth:`settle` as a machine (its polls are :class:`~agentkv._support.effects.Wait` effects): a worker
        thread waits only while it holds one of two slots (else it confirms at once); a task always waits."""
        slot = yield Call(_settling_slot, _no_slot)
        if slot is False:
            self._confirmed(ids, self._settled(ids))
            return
        try:
            deadline = time.monotonic() + self.settle_s
            while not (settled := self._settled(ids)) and self.ledger.live(self.backend) and time.monotonic() < deadline:
                yield Wait(_POLL_S)
        finally:
            if slot:
                _SETTLING.release()
        self._confirmed(ids, settled)


def _settling_slot() -> bool:
    """One of the two settle slots for a worker thread (False: both held, it does not wait)."""
    return _SETTLING.acquire(blocking=False)


async def _no_slot() -> None:
    """A task needs no slot: its waits hold no thread."""
    return None
