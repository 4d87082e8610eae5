"""Which replica of a pool serves a conversation: rendezvous (highest random weight) hashing, pure.

Every replica gets a score from the conversation's routing key and the replica's URL; the conversation goes to the
highest-scoring replica that is up. A replica leaving moves only the conversations it served (each to its own next
replica), and one coming back takes back only those: nothing else moves, and no table is kept.

    order = ranked("5f0c…", ("http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"))
    choose("5f0c…", replicas, down=frozenset({order[0]}))   # -> order[1]
"""

from __future__ import annotations

import hashlib
import math
from typing import Collection, Mapping, Sequence

__all__ = ["HOME_IDLE_S", "HOME_MAX_ACTIVE", "HOME_SLACK", "HOME_TENANT_SHARE", "choose", "first_up", "home_by_load",
           "pool_id", "ranked", "store_id", "tenant_cap"]

# A new conversation's home is its first-ranked replica with fewer active conversations than
# ceil(HOME_SLACK * (active + 1) / replicas up) (consistent hashing with bounded loads: 30 conversations on 3 replicas
# land 10/10/10, where hashing alone gives max/min > 1.5 six times in ten); a conversation is active while its last
# request is under HOME_IDLE_S old (the state store keeps the homes: agentkv.state.StateStore.home_replica).
HOME_SLACK = 1.0
HOME_IDLE_S = 900.0
# A store keeps at most HOME_MAX_ACTIVE active conversations per pool, and one tenant at most HOME_TENANT_SHARE of them
# (a tenant minting session ids fills only its own share). A new conversation past either is placed by rendezvous
# alone (its first replica up) and not stored: it keeps that replica while the pool's replicas stay up.
HOME_MAX_ACTIVE = 1_000_000
HOME_TENANT_SHARE = 0.25
_ID_DOMAIN = b"agentkv-store-id-v1"


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


def first_up(ranked: Sequence[str], down: Collection[str]) -> str:
    """Plain rendezvous: the first of ``ranked`` not ``down`` (the first of all when every one is)."""
    return next((replica for replica in ranked if replica not in down), ranked[0])


def home_by_load(ranked: Sequence[str], down: Collection[str], active: Mapping[str, int], slack: float) -> str:
    """A new conversation's home (consistent hashing with bounded loads): the first of ``ranked`` not ``down`` whose
    ``active`` conversations (per replica; absent is none) are under ``ceil(slack * (active on those up + 1) / up)``.
    O(replicas): the counts are kept by the store, never counted here."""
    up = [replica for replica in ranked if replica not in down] or list(ranked)
    counts = [max(0, active.get(replica, 0)) for replica in up]
    cap = math.ceil(slack * (sum(counts) + 1) / len(up))
    return next((replica for replica, count in zip(up, counts) if count < cap), up[0])


def tenant_cap(max_active: int, share: float, tenant: str = "?") -> int:
    """How many of a pool's ``max_active`` conversations one tenant may hold: its ``share`` of them, at least one.
    Conversations of no tenant (``tenant`` empty: a deployment that names none) may hold the whole bound."""
    return max_active if not tenant else max(1, int(max_active * share))


def store_id(kind: str, value: str, secret: str | bytes | None) -> str:
    """The opaque id ``value`` (a replica's URL, a tenant, a pool) is stored under in a shared store: 16 hex characters
    of BLAKE2b keyed by ``secret`` (the cache-salt secret), so a dictionary of names or URLs matches nothing. Without a
    secret, the hash is keyed by a fixed domain string instead: unkeyed, but no plain SHA-256 of a name. ``kind``
    separates the kinds of value (a tenant and a URL that are the same text get different ids)."""
    key = secret.encode() if isinstance(secret, str) else (secret or b"")
    if len(key) > 64:  # BLAKE2b takes keys of up to 64 bytes
        key = hashlib.sha256(key).digest()
    digest = hashlib.blake2b(digest_size=8, key=key or _ID_DOMAIN, person=b"agentkv-store")
    digest.update(kind.encode() + b"\0" + value.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()
