"""When a pool's replica is ejected: a circuit breaker per replica, fed what happened to each try, pure.

An outage is a replica's, not a request's. A replica is ejected only on evidence that it is failing:

- ``"down"``: it refused or reset a connection (the replica's own failure, whatever was sent): ejected at once;
- ``"failed"``: a try failed over (a 502/503/504, a read timeout where the policy fails those over, a connection
  closed without an answer): one request's failure, unless it repeats. :attr:`BreakerRule.failures` such failures in a
  row (no try answered between them) within :attr:`BreakerRule.window_s`, from at least
  :attr:`BreakerRule.conversations` distinct conversations, eject it;
- ``"ok"``: a try answered: the streak starts again.

One tenant cannot eject a replica that another uses: the streak must hold :attr:`BreakerRule.tenants` distinct tenants,
unless the failing tenant is the only one that used the replica in the window; such an ejection is this process's own
(``shared=False``: it is not written to the state store, where other processes' tenants would be moved by it).

    record, verdict = ReplicaRecord().observe(conversation, tenant, "failed", now, BreakerRule())

Conversations and tenants are opaque digests (the caller's); the record keeps a bounded number of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BreakerRule", "Evidence", "ReplicaRecord", "Verdict"]

Evidence = Literal["ok", "down", "failed"]

_STREAK_LIMIT = 32  # failures kept per replica (more only repeats what the rule already counts)
_USERS_LIMIT = 64  # tenants remembered per replica (the most recent)


@dataclass(frozen=True)
class BreakerRule:
    """How much evidence ejects a replica: ``failures`` failed tries in a row within ``window_s``, from at least
    ``conversations`` conversations and ``tenants`` tenants (one, when only one tenant used the replica in the window).

        BreakerRule(failures=3, conversations=2, tenants=2, window_s=30.0)
    """

    failures: int = 3
    conversations: int = 2
    tenants: int = 2
    window_s: float = 30.0


@dataclass(frozen=True)
class Verdict:
    """What the breaker says: ``eject`` the replica or not, ``shared`` (through the state store, for every process) or
    this process's alone, and ``why`` in a word ("refused", "failures", "" when not ejected)."""

    eject: bool = False
    shared: bool = False
    why: str = ""


KEEP = Verdict()


@dataclass(frozen=True)
class ReplicaRecord:
    """One replica's recent history: the failures since its last answer (``streak``: conversation, tenant, when) and the
    tenants that sent it tries (``users``: tenant, last seen)."""

    streak: tuple[tuple[str, str, float], ...] = ()
    users: tuple[tuple[str, float], ...] = ()

    def observe(self, conversation: str, tenant: str, evidence: Evidence, at: float,
                rule: BreakerRule) -> tuple[ReplicaRecord, Verdict]:
        """The record after a try of ``conversation`` (of ``tenant``) ended in ``evidence`` at ``at``, and the
        verdict."""
        since = at - rule.window_s
        users = tuple((t, when) for t, when in self.users if t != tenant and when > since)[-(_USERS_LIMIT - 1):]
        users += ((tenant, at),)
        if evidence == "ok":
            return ReplicaRecord((), users), KEEP
        if evidence == "down":
            return ReplicaRecord((), users), Verdict(True, True, "refused")
        streak = tuple(f for f in self.streak if f[2] > since)[-(_STREAK_LIMIT - 1):] + ((conversation, tenant, at),)
        return ReplicaRecord(streak, users), _judged(streak, users, rule)


def _judged(streak: tuple[tuple[str, str, float], ...], users: tuple[tuple[str, float], ...],
            rule: BreakerRule) -> Verdict:
    """Whether ``streak`` (the failures in a row, in the window) ejects the replica, given its ``users``."""
    if len(streak) < rule.failures or len({c for c, _, _ in streak}) < rule.conversations:
        return KEEP
    tenants = {t for _, t, _ in streak}
    if len(tenants) >= rule.tenants:
        return Verdict(True, True, "failures")
    if {t for t, _ in users} <= tenants:  # only the failing tenant used it: its own ejection, in this process
        return Verdict(True, False, "failures")
    return KEEP
