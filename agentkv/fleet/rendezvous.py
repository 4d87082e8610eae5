"""Which replica of a pool serves a conversation: rendezvous (highest random weight) hashing, pure.

Every replica gets a score from the conversation's routing key and the replica's URL; the conversation goes to the
highest-scoring replica that is up. A replica leaving moves only the conversations it served (each to its own next
replica), and one coming back takes back only those: nothing else moves, and no table is kept.

    order = ranked("5f0c…", ("http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"))
    choose("5f0c…", replicas, down=frozenset({order[0]}))   # -> order[1]
"""

from __future__ import annotations

import hashlib
from typing import Collection, Sequence

__all__ = ["HOME_IDLE_S", "HOME_SLACK", "choose", "pool_id", "ranked"]

# A new conversation's home is its first-ranked replica with fewer active conversations than
# ceil(HOME_SLACK * (active + 1) / replicas up) (consistent hashing with bounded loads: 30 conversations on 3 replicas
# land 10/10/10, where hashing alone gives max/min > 1.5 six times in ten); a conversation is active while its last
# request is under HOME_IDLE_S old (the state store keeps the homes: agentkv.state.StateStore.home_replica).
HOME_SLACK = 1.0
HOME_IDLE_S = 900.0


def _score(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


def ranked(key: str, replicas: Sequence[str]) -> tuple[str, ...]:
    """``replicas`` in the conversation's order of preference (its first choice first)."""
    return tuple(sorted(replicas, key=lambda replica: (-_score(key, replica), replica)))


def choose(key: str, replicas: Sequence[str], *, down: Collection[str] = (), tried: Collection[str] = ()) -> str | None:
    """The replica ``key``'s conversation goes to: its highest-ranked one neither ``down`` nor ``tried`` (this turn).
    When every untried replica is down, the highest-ranked untried one (a cool-off is a guess; a try tells); None when
    every replica was tried this turn."""
    if len(replicas) == 1:
        return None if replicas[0] in tried else replicas[0]
    order = [replica for replica in ranked(key, replicas) if replica not in tried]
    return next((replica for replica in order if replica not in down), order[0] if order else None)


def pool_id(label: str, replicas: Sequence[str]) -> str:
    """The name a pool's homes are kept under: its label and its replicas (a changed pool starts afresh)."""
    return f"{label}|{','.join(sorted(replicas))}"
