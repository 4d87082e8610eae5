"""Warm-ahead decisions and guards, without a server."""

import threading

import pytest

from agentkv.errors import ConfigurationError
from agentkv.testing import FakeClock, FakeHttp, models_answer
from agentkv.warm import CooldownMap, InFlightLimit, WarmAheadPolicy, decide_warm
from agentkv.tenancy import derive_cache_salt, with_cache_salt

POLICY = WarmAheadPolicy()


def decide(tokens, **kw):
    args = dict(estimated_tokens=tokens, fast_window=1000, routed_role="fast", enabled=True, model_known=True,
                policy=POLICY)
    args.update(kw)
    return decide_warm(**args).outcome


def on_threads(work, count):
    """Run ``work(i)`` on ``count`` threads at once and wait for all of them."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_threshold_is_sixty_percent():
    """Below 60% of the fast window nothing fires; at 60% it fires."""
    assert decide(599) == "below_threshold"
    assert decide(600) == "fire"


def test_guards_in_order():
    """Routed-to-slow, disabled and unknown-model each stop a warm, and say which."""
    assert decide(700, routed_role="slow") == "routed_slow"
    assert decide(700, enabled=False) == "disabled"
    assert decide(700, model_known=False) == "unknown_model"
    assert decide(700, fast_window=None) == "no_window"


def test_cooldown_one_per_session_per_ttl():
    """A session claims once per cooldown; after the TTL on the fake clock it may claim again."""
    clock = FakeClock()
    view = CooldownMap(ttl_s=300, timer=clock).for_tenant("acme")
    assert view.claim("s1") and not view.claim("s1")
    clock.advance(299)
    assert not view.claim("s1")
    clock.advance(2)
    assert view.claim("s1")


def test_tenants_cannot_touch_each_other():
    """One tenant's view cannot read or reset another tenant's entry for the same session id."""
    shared = CooldownMap()
    a, b = shared.for_tenant("a"), shared.for_tenant("b")
    assert a.claim("chat-1")
    assert not b.active("chat-1")
    b.reset("chat-1")
    assert a.active("chat-1")
    assert not hasattr(shared, "keys") and not hasattr(a, "keys")


def test_map_stays_bounded_under_threads():
    """1,000 sessions of 8 tenants across 8 threads leave at most 100 entries a tenant and raise nothing."""
    shared = CooldownMap(maxsize=100)
    errors = []

    def work(t):
        try:
            view = shared.for_tenant(f"tenant-{t}")
            for i in range(125):
                view.claim(f"s-{i}")
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    on_threads(work, 8)
    assert not errors and shared.size() == 8 * 100


def test_in_flight_limit_skips_past_bound():
    """Past N in flight, acquiring fails at once instead of queueing."""
    limit = InFlightLimit(2)
    assert limit.try_acquire() and limit.try_acquire() and not limit.try_acquire()
    limit.release()
    assert limit.try_acquire()


def test_policy_validation():
    """A threshold outside (0, 1] is refused by name."""
    with pytest.raises(ConfigurationError, match="threshold"):
        WarmAheadPolicy(threshold=1.5)


def test_salt_is_hmac_of_tenant_and_added_without_mutation():
    """The salt is stable per tenant, differs across tenants, and is added to a copy of extra_body."""
    assert derive_cache_salt("s3cret", "a") == derive_cache_salt("s3cret", "a") != derive_cache_salt("s3cret", "b")
    extra = {"chat_template_kwargs": {"x": 1}}
    call = with_cache_salt({"extra_body": extra}, "salt")
    assert call["extra_body"] == {"chat_template_kwargs": {"x": 1}, "cache_salt": "salt"}
    assert extra == {"chat_template_kwargs": {"x": 1}}


def test_a_thousand_sessions_across_eight_threads_keep_the_shared_map_bounded():
    """1,000 real Sessions of 8 tenants on 8 threads, each firing a warm, leave the shared cooldown map at 100 a tenant."""
    from agentkv import Backend, Session, WindowDiscovery
    from agentkv.warm import InFlightLimit

    class Instant:
        def completion(self, **kwargs):
            return {"choices": [{"message": {"role": "assistant", "content": ""}}], "usage": {}}

    shared = CooldownMap(maxsize=100)
    discovery = WindowDiscovery(http=FakeHttp(lambda method, url, body: models_answer("big", 100_000)))
    fast = Backend("hosted_vllm/small", api_base="http://127.0.0.1:9/v1", name="fast", window=1000)
    slow = Backend("hosted_vllm/big", api_base="http://127.0.0.1:8/v1", name="slow")
    message = [{"role": "user", "content": "word " * 700}]
    fired, errors = [], []

    def work(t):
        try:
            for i in range(125):
                s = Session(fast, slow, tenant=f"tenant-{t}", session_id=f"s-{i}", cooldowns=shared, client=Instant(),
                            discovery=discovery, in_flight=InFlightLimit(10_000), count_with_server=False)
                fired.append(s.observe(messages=message).warm)
                s.drain_warms(10)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    on_threads(work, 8)
    assert not errors, errors[:1]
    assert fired.count("fire") == 1000 and shared.size() == 8 * 100


def test_policy_settings_shape_the_shared_guards():
    """A Session's WarmAheadPolicy sets its cooldown length, map size and in-flight bound."""
    from agentkv import Backend, Session
    from agentkv.warm import shared_cooldowns, shared_in_flight

    policy = WarmAheadPolicy(cooldown_s=0.5, max_sessions=7, max_in_flight=1)
    s = Session(Backend("a"), Backend("b"), warm_ahead=policy, tenant="t")
    assert s._parts.state._guards(s._parts.warm._claim()) == (shared_cooldowns(7, 0.5), shared_in_flight(1))
    assert shared_cooldowns(7, 0.5).maxsize == 7 and shared_cooldowns(7, 0.5).ttl_s == 0.5
    slot = shared_in_flight(1)
    assert slot.try_acquire() and not slot.try_acquire()
    slot.release()


def test_tenant_salt_replaces_a_salt_from_the_request_body():
    """A cache_salt arriving in extra_body cannot override the tenant's salt, and the swap is logged."""
    from agentkv.testing import capture_events

    from agentkv.tenancy import screen_caller_salts

    request = {"extra_body": {"cache_salt": "attacker"}}
    with capture_events() as events:
        screen_caller_salts(request, "tenant-salt", keep=False)  # the Session's entry logs it; the builder swaps
    assert with_cache_salt(request, "tenant-salt")["extra_body"]["cache_salt"] == "tenant-salt"
    assert any(e["event"] == "cache_salt_replaced" for e in events)
