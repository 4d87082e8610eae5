"""agentkv: fast/slow model routing for agents that never loses a turn at the moment of escalation.

    from agentkv import Session, Backend

    fast = Backend("hosted_vllm/qwen3-8b", api_base="http://127.0.0.1:8001/v1")
    slow = Backend("hosted_vllm/qwen3-32b", api_base="http://127.0.0.1:8002/v1", window=131072)
    with Session(fast=fast, slow=slow, tenant="acme") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)

``import agentkv`` is cheap: litellm, torch and transformers are imported where they are used.
"""

from agentkv._session import Observation, Session
from agentkv.backends import Backend, WindowInfo
from agentkv.discovery import WindowDiscovery, default_discovery
from agentkv.errors import AgentKVError, ConfigurationError, ContextOverflowError, InvalidRequestError
from agentkv.overflow import Overflow, overflow_from_error, parse_overflow
from agentkv.prefix import PrefixReport
from agentkv.protocols import CompletionClient, SessionLike
from agentkv.retry import RetryPolicy
from agentkv.routing import Recovery, RouteDecision, RoutePolicy, decide_route, plan_recovery
from agentkv.stats import LedgerEntry
from agentkv.tenancy import derive_cache_salt
from agentkv.tokens import Payload, TokenCount, TokenCounter, payload_from_request
from agentkv.react import RunResult, Tool
from agentkv.toolschema import function_schema
from agentkv.warm import CooldownMap, WarmAheadPolicy, WarmDecision, decide_warm

# Bound last: ``agentkv.session`` is the decorator (the Session class lives in ``agentkv._session``).
from agentkv.decorator import (  # noqa: E402
    NoSessionError, acompletion, completion, configure, current_session, session,
)

__version__ = "0.1.0"

__all__ = [
    "AgentKVError",
    "Backend",
    "CompletionClient",
    "ConfigurationError",
    "ContextOverflowError",
    "CooldownMap",
    "InvalidRequestError",
    "LedgerEntry",
    "NoSessionError",
    "Observation",
    "Overflow",
    "Payload",
    "PrefixReport",
    "Recovery",
    "RetryPolicy",
    "RouteDecision",
    "RunResult",
    "RoutePolicy",
    "Session",
    "SessionLike",
    "TokenCount",
    "TokenCounter",
    "Tool",
    "WarmAheadPolicy",
    "WarmDecision",
    "WindowDiscovery",
    "WindowInfo",
    "__version__",
    "acompletion",
    "completion",
    "configure",
    "current_session",
    "decide_route",
    "decide_warm",
    "default_discovery",
    "derive_cache_salt",
    "function_schema",
    "overflow_from_error",
    "parse_overflow",
    "payload_from_request",
    "plan_recovery",
    "session",
]
