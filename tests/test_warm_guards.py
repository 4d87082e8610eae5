"""The in-process cooldown map bounds each tenant separately: no tenant can evict another's running cooldown."""

from agentkv.state import InProcessStore, WarmClaim
from agentkv.testing import FakeClock
from agentkv.warm import CooldownMap, InFlightLimit


def _claim(tenant: str, session: str) -> WarmClaim:
    return WarmClaim(tenant, session, cooldown_s=300.0, max_sessions=256, limit=10_000, lease_s=31.0)


def test_a_tenant_opening_300_sessions_leaves_another_tenants_cooldown_running():
    """Tenant A's 300 warming sessions evict only A's oldest entries; B's cooldown still refuses B's next warm."""
    store = InProcessStore(CooldownMap(maxsize=256), InFlightLimit(10_000))
    assert store.claim(_claim("tenant-B", "chat-1"))[0] == "fire"
    for i in range(300):
        outcome, lease = store.claim(_claim("tenant-A", f"s{i}"))
        assert outcome == "fire" and lease is not None
        store.release(lease)
    assert store.claim(_claim("tenant-B", "chat-1"))[0] == "cooldown"


def test_each_tenants_map_is_bounded_and_evicts_its_own_oldest():
    """300 sessions of one tenant leave 256 of its entries (the oldest evicted, as the Redis store does)."""
    cooldowns = CooldownMap(maxsize=256)
    a, b = cooldowns.for_tenant("a"), cooldowns.for_tenant("b")
    assert b.claim("other")
    for i in range(300):
        assert a.claim(f"s{i}")
    assert cooldowns.size() == 257
    assert a.claim("s0") and not a.claim("s299") and b.active("other")


def test_past_max_tenants_a_new_tenant_skips_its_warm_and_evicts_no_one():
    """With the tenant table full of live cooldowns a newcomer's claim is refused; once they expire it is let in."""
    clock = FakeClock()
    cooldowns = CooldownMap(maxsize=4, ttl_s=300.0, timer=clock, max_tenants=3)
    for tenant in ("a", "b", "c"):
        assert cooldowns.for_tenant(tenant).claim("s")
    assert not cooldowns.for_tenant("d").claim("s")
    assert all(cooldowns.for_tenant(t).active("s") for t in ("a", "b", "c"))
    clock.advance(301.0)
    assert cooldowns.for_tenant("d").claim("s") and cooldowns.size() == 1


def test_a_reset_frees_the_tenants_slot_in_the_table():
    """A tenant whose last cooldown was reset holds no place among max_tenants."""
    cooldowns = CooldownMap(maxsize=4, max_tenants=1)
    a = cooldowns.for_tenant("a")
    assert a.claim("s")
    a.reset("s")
    assert cooldowns.for_tenant("b").claim("s")
