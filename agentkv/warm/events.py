"""Event-aware warm-ahead's decision (pure): what the slow server's prefix cache holds decides the warm.

A Session with a :class:`~agentkv.cache_ledger.CacheLedger` that follows its slow backend learns, off the request
path, the slow server's token ids for the prompt and reads from the ledger how many of them the server holds
for the tenant's salt. :func:`decide_event_warm` then turns those numbers into one outcome:

- ``fire``: a claimed warm (the cooldown had run out) is sent;
- ``skip_resident``: a claimed warm is not sent, the server already holds the prompt but for a tail shorter
  than ``top_up_tokens``;
- ``rewarm_evicted``: inside the cooldown, the prefix this session warmed has lost blocks: warm again;
- ``top_up``: inside the cooldown, the warmed prefix is resident but the prompt has grown ``top_up_tokens``
  past what the server holds: warm the tail (its prefill is all the top-up costs);
- ``cooldown``: inside the cooldown, nothing to do.

Usage::

    decide_event_warm(Residency(prompt_tokens=9000, held_tokens=7168, warmed_tokens=7168, warmed_held=7168),
                      claimed=False, policy=WarmAheadPolicy(top_up_tokens=1024))   # -> "top_up"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentkv.warm.policy import WarmAheadPolicy

__all__ = ["EventOutcome", "Residency", "SENDS", "decide_event_warm"]

EventOutcome = Literal["fire", "skip_resident", "rewarm_evicted", "top_up", "cooldown"]
SENDS: tuple[EventOutcome, ...] = ("fire", "rewarm_evicted", "top_up")  # the outcomes that send a warm


@dataclass(frozen=True)
class Residency:
    """What the ledger says the slow server holds of one session's prompt, under the tenant's salt.

    ``prompt_tokens``: the prompt's length in the slow server's tokens; ``held_tokens``: its leading tokens
    held in full blocks; ``warmed_tokens``: how many tokens of the prefix this session last warmed the ledger
    showed held once that warm was done (None: no warm yet); ``warmed_held``: how many of them it holds now.
    """

    prompt_tokens: int
    held_tokens: int
    warmed_tokens: int | None = None
    warmed_held: int = 0

    @property
    def tail(self) -> int:
        """Tokens of the prompt the server would have to prefill."""
        return max(0, self.prompt_tokens - self.held_tokens)

    @property
    def evicted(self) -> bool:
        """The warmed prefix has lost blocks since it was warmed."""
        return self.warmed_tokens is not None and self.warmed_held < self.warmed_tokens


def decide_event_warm(residency: Residency, *, claimed: bool, policy: WarmAheadPolicy) -> EventOutcome:
    """The event-aware outcome; ``claimed``: this request holds a fresh warm claim (its cooldown had run out)."""
    if claimed:
        resident = residency.held_tokens > 0 and residency.tail < policy.top_up_tokens
        return "skip_resident" if resident else "fire"
    if not residency.warmed_tokens:
        # nothing this session warmed to check (another replica may have), or its warm never showed in the
        # ledger (events not arriving): without a baseline, the cooldown decides
        return "cooldown"
    if residency.evicted:
        return "rewarm_evicted"
    return "top_up" if residency.tail >= policy.top_up_tokens else "cooldown"
