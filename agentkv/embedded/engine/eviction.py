"""Which cached block goes when the embedded engine's block pool is full: a pure decision over per-group facts.

A *group* is what one ``cache_salt`` names (the server cannot know tenants; salts are opaque to it, and unsalted
requests form their own group, ``None``). The prefix cache hands :func:`victim_group` one :class:`GroupFacts`
per group that has an evictable block (resident, not in use by a running request, not part of the chain being
inserted) and evicts the coldest evictable block of the group it names.

- ``"fair"``: the group furthest over its fair share (``capacity / groups holding blocks``) gives up its coldest
  block; among groups equally far over, the one whose coldest block is colder. And a group at or over its share
  that is inserting never takes a block from a group under its share: when it has nothing of its own to give up
  (its every block is in use or part of the chain it inserts), its chain stops being cached instead. One tenant's
  flood (or its warms, or one prompt larger than the pool) therefore never evicts another tenant's prefix held
  within that tenant's share. With one group this *is* LRU.
- ``"lru"``: the coldest evictable block of all, whoever holds it: vLLM's ``FreeKVCacheBlockQueue`` order
  (``vllm/v1/core/block_pool.py`` pops the queue's head; a finished request's blocks go to its tail, chain
  tail first, so a prefix loses its tail before its head).

Limits of ``"fair"``: it is fair per salt, not per tenant. The share is ``capacity / groups``, so whoever may choose
salts freely can claim one share per salt it mints and shrink everyone's (ten salts, each one block, evict a
three-block prefix held within its two-group share). Fairness between tenants holds only where a gateway derives
one salt per tenant (:func:`agentkv.tenancy.derive_cache_salt`) and tenants cannot send their own. Blocks a running
request pins count toward its group's share but cannot be evicted, so many long requests hold what they pin.

Usage::

    victim = victim_group("fair", [GroupFacts("a", used=900, coldest=3), GroupFacts("b", used=100, coldest=1)],
                          capacity=1000, groups=2)
    victim.group   # "a": 400 over its share of 500; b is under
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal, Sequence, get_args

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "GroupFacts", "check_policy", "victim_group"]

EvictionPolicy = Literal["fair", "lru"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)


@dataclass(frozen=True)
class GroupFacts:
    """One group with at least one evictable block: ``used`` bytes it holds in all (in use or not) and the
    recency tick of its coldest evictable block (smaller is colder)."""

    group: Hashable
    used: int
    coldest: int


def check_policy(policy: str) -> EvictionPolicy:
    """``policy`` if it names an eviction policy; ValueError otherwise."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, not {policy!r}")
    return policy  # type: ignore[return-value]


def victim_group(policy: EvictionPolicy, candidates: Sequence[GroupFacts], *, capacity: int, groups: int,
                 incoming: GroupFacts | None = None) -> GroupFacts | None:
    """The candidate whose coldest evictable block goes next; None when none may go (``group`` itself may be
    None: the unsalted group).

    ``capacity``: what the pool holds when full (bytes); ``groups``: how many groups hold blocks or are inserting
    (those whose every block is in use count toward the share too); ``incoming``: the group inserting (its
    ``used`` bytes; ``coldest`` is ignored), None when the pool shrinks.
    """
    if not candidates:
        return None
    if policy == "lru":
        return min(candidates, key=lambda c: c.coldest)
    share = capacity / max(groups, 1)
    victim = min(candidates, key=lambda c: (-(c.used - share), c.coldest))
    if incoming is not None and victim.group != incoming.group and victim.used <= share <= incoming.used:
        return None
    return victim
