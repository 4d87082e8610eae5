"""The public surface: a pinned __all__, a cheap import, value objects that refuse bad input."""

import subprocess
import sys

import pytest

import agentkv
from agentkv import Backend, ConfigurationError, Session

EXPECTED = {
    "AgentKVError", "Attempt", "Backend", "CompletionClient", "ConfigurationError", "ContextOverflowError",
    "Conversations", "Handoff", "HttpError", "HttpTransport", "InvalidRequestError", "LedgerEntry", "NoSessionError",
    "Observation", "PoolExhaustedError", "PrefixReport", "RetryPolicy", "RouteDecision", "RoutePolicy", "RunResult",
    "Session", "SessionLike",
    "TokenCount", "Tool", "TurnEnd", "WarmAheadPolicy", "WindowDiscovery", "acompletion", "completion",
    "configure", "current_session", "derive_cache_salt", "function_schema", "session",
}
# The pure core, exported by its own modules only.
CORE = {
    "decide_route": "agentkv.routing", "plan_recovery": "agentkv.routing", "Recovery": "agentkv.routing",
    "decide_warm": "agentkv.warm", "WarmDecision": "agentkv.warm", "CooldownMap": "agentkv.warm",
    "overflow_from_error": "agentkv.overflow", "parse_overflow": "agentkv.overflow", "Overflow": "agentkv.overflow",
    "payload_from_request": "agentkv.tokens", "Payload": "agentkv.tokens", "TokenCounter": "agentkv.tokens",
    "default_discovery": "agentkv.discovery", "WindowInfo": "agentkv.backends",
}


def test_the_pure_core_is_exported_by_its_own_modules():
    """Each pure-core name is in its own module's ``__all__``; ``agentkv`` itself does not export it."""
    import importlib

    for name, module in CORE.items():
        owner = importlib.import_module(module)
        assert name in owner.__all__ and getattr(owner, name) is not None, name
        assert name not in agentkv.__all__ and not hasattr(agentkv, name), name


def test_session_name_is_the_decorator():
    """agentkv.session is the decorator; the Session class is agentkv.Session."""
    import agentkv.decorator

    assert agentkv.session is agentkv.decorator.session and agentkv.Session.__name__ == "Session"


def test_exported_members_are_pinned():
    """agentkv.__all__ is exactly the curated list, and every name resolves."""
    assert set(agentkv.__all__) == EXPECTED
    for name in agentkv.__all__:
        assert getattr(agentkv, name) is not None


def test_lazy_exports_are_exactly_all():
    """The names ``agentkv`` loads on first use are exactly ``__all__``: nothing importable from the package top is
    left out of the curated list, and ``__version__`` is an attribute."""
    assert set(agentkv._EXPORTS) == set(agentkv.__all__)
    assert agentkv.__version__ and "__version__" not in agentkv.__all__


def test_import_is_cheap():
    """`import agentkv` loads neither litellm, torch, transformers nor langchain."""
    code = ("import sys, agentkv, agentkv.embedded, agentkv.handoff, agentkv.integrations; "
            "print(sorted(m for m in ('litellm', 'torch', 'transformers', 'langchain_core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("kwargs,needle", [
    ({"model": ""}, "model"),
    ({"model": "m", "window": 0}, "window"),
    ({"model": "m", "api_base": "127.0.0.1:8000"}, "api_base"),
])
def test_backend_refuses_bad_values(kwargs, needle):
    """A Backend with a bad value raises a ConfigurationError naming the field."""
    with pytest.raises(ConfigurationError, match=needle):
        Backend(**kwargs)


def test_session_refuses_bad_backends():
    """A Session needs Backend objects with distinct names."""
    with pytest.raises(ConfigurationError, match="fast"):
        Session("hosted_vllm/x")
    with pytest.raises(ConfigurationError, match="distinct"):
        Session(Backend("m"), Backend("m"))


def test_session_id_defaults_to_a_fresh_uuid():
    """Two Sessions get different generated ids."""
    assert Session(Backend("a")).session_id != Session(Backend("a")).session_id


def test_bad_max_tokens_is_named():
    """A non-positive max_tokens is refused before anything is sent."""
    with Session(Backend("hosted_vllm/m", window=100), client=object()) as s, pytest.raises(ValueError, match="max_tokens"):
        s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=0)


def test_events_carry_hashes_not_prompt_text(monkeypatch):
    """Route events carry a prompt hash and sizes; text appears only with AGENTKV_LOG_PROMPTS=1."""
    from agentkv.testing import capture_events

    secret = "the launch code is 0000"

    class Echo:
        def completion(self, **kwargs):
            return {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {}}

    with Session(Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", window=4096), client=Echo(),
                 count_with_server=False) as s:
        with capture_events() as quiet:
            s.completion(messages=[{"role": "user", "content": secret}], max_tokens=4)
        monkeypatch.setenv("AGENTKV_LOG_PROMPTS", "1")
        with capture_events() as loud:
            s.completion(messages=[{"role": "user", "content": secret}], max_tokens=4)
    route = next(e for e in quiet if e["event"] == "route")
    assert route["prompt_hash"] and route["messages"] == 1
    assert secret not in repr(quiet)
    assert secret in repr(loud)


def test_events_dropped_by_a_filtering_logger_are_not_computed(monkeypatch):
    """Under structlog's filtering logger at WARNING, info is reported disabled and the route event's prompt
    hash is not computed; with the default logger it is."""
    import logging

    import structlog

    from agentkv import events

    hashed = []
    monkeypatch.setattr("agentkv._session.processors.prompt_fields", lambda p: hashed.append(p) or {})
    fast = Backend("hosted_vllm/m", window=4096)
    try:
        assert events.enabled("info") and events.enabled("debug")
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        assert not events.enabled("info") and events.enabled("warning")
        with Session(fast, client=_Instant()) as s:
            s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert hashed == []
    finally:
        structlog.reset_defaults()
    with Session(fast, client=_Instant()) as s:
        s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert len(hashed) == 1


class _Instant:
    """A completion client that answers at once (no server involved in what this test proves)."""

    def completion(self, **kwargs):
        return {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    async def acompletion(self, **kwargs):  # pragma: no cover - the test is sync
        return self.completion(**kwargs)


def test_events_reach_a_logger_configured_to_log_them():
    """A filtering logger at INFO, and structlog over stdlib logging, both get the route event with its prompt
    hash (events.enabled only skips what a filtering logger drops)."""
    import io
    import logging

    import structlog

    from agentkv import events

    fast, seen = Backend("hosted_vllm/m", window=4096), []

    def grab(logger, name, event_dict):
        seen.append(dict(event_dict))
        raise structlog.DropEvent

    stream, root = io.StringIO(), logging.getLogger("agentkv")
    handler, level = logging.StreamHandler(stream), root.level
    try:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO), processors=[grab])
        assert events.enabled("info") and not events.enabled("debug")
        with Session(fast, client=_Instant()) as s:
            s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert [e for e in seen if e["event"] == "route" and e.get("prompt_hash")]
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        structlog.configure(processors=[structlog.stdlib.filter_by_level, structlog.processors.JSONRenderer()],
                            logger_factory=structlog.stdlib.LoggerFactory(), wrapper_class=structlog.stdlib.BoundLogger)
        assert events.enabled("info")
        with Session(fast, client=_Instant()) as s:
            s.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert '"event": "route"' in stream.getvalue() and '"prompt_hash"' in stream.getvalue()
    finally:
        structlog.reset_defaults()
        root.removeHandler(handler)
        root.setLevel(level)
