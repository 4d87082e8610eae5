"""A warm's claims on the :class:`~agentkv.state.StateStore`: what is claimed, and the claim and release as machines.

A conversation's warm claims its cooldown and an in-flight slot (:func:`conversation_claim`); an event-aware
re-warm or top-up claims an in-flight slot alone, under its tenant's event namespace (:func:`event_claim`). The store
is a seam: :func:`claimed` and :func:`released` yield its calls (:mod:`agentkv._support.effects`), so one body serves
the sync and the async driver. An unreachable store is an outcome (``"state_unavailable"``), never an error.

    outcome, lease = yield from claimed(store, conversation_claim(policy, "acme", "s1"))
    yield from released(store, lease)
"""

from __future__ import annotations

from agentkv._support.effects import Call, Machine
from agentkv.state.protocol import Lease, StateStore, StateUnavailable, WarmClaim
from agentkv.warm.policy import WarmAheadPolicy

__all__ = ["EVENT_SEP", "claimed", "conversation_claim", "event_claim", "event_namespace", "released"]

EVENT_SEP = "\x00"  # no tenant name holds it, so no tenant's cooldown map is another's event namespace


def event_namespace(tenant: str | None) -> str:
    """The namespace of a tenant's re-warm and top-up claims (a tenant named ``acme#event`` cannot reach acme's)."""
    return f"{tenant or ''}{EVENT_SEP}event"


def conversation_claim(policy: WarmAheadPolicy, tenant_key: str | None, session_id: str,
                       replica: str | None = None) -> WarmClaim:
    """A conversation's warm: its cooldown (per pool replica, so a conversation moved to another replica is warmed
    there again) and an in-flight slot held for the warm's timeout."""
    session = session_id if replica is None else f"{session_id}@{replica}"
    return WarmClaim(tenant_key or "", session, policy.cooldown_s, policy.max_sessions, policy.max_in_flight,
                     lease_s=policy.timeout_s + 1.0)


def event_claim(policy: WarmAheadPolicy, tenant_key: str | None, session_id: str, serial: int) -> WarmClaim:
    """A re-warm's or top-up's claim (the session's ``serial``-th): an in-flight slot, under the tenant's own event
    namespace (so its short marker never shortens, crowds or expires the tenant's cooldowns) and a key of its own (the
    session's one check at a time, :attr:`~agentkv.warm.aware.SlowResidency.busy`, is what spaces them)."""
    return WarmClaim(event_namespace(tenant_key), f"{session_id}#{serial}", policy.timeout_s + 1.0,
                     policy.max_sessions, policy.max_in_flight, lease_s=policy.timeout_s + 1.0)


def claimed(store: StateStore, claim: WarmClaim) -> Machine[tuple[str, Lease | None]]:
    """The store's outcome for ``claim`` ("fire" with a lease, "cooldown", "saturated") or "state_unavailable"."""
    try:
        outcome, lease = yield Call(store.claim, store.aclaim, (claim,))
    except StateUnavailable:
        return "state_unavailable", None
    return str(outcome), lease


def released(store: StateStore, lease: Lease | None) -> Machine[None]:
    """Give ``lease`` back (None: nothing to give); an unreachable store lets it expire on its own."""
    if lease is None:
        return
    try:
        yield Call(store.release, store.arelease, (lease,))
    except StateUnavailable:
        return  # the lease expires after its lease_s
