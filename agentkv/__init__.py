"""agentkv: fast/slow model routing for agents that never loses a turn at the moment of escalation.

    from agentkv import Session, Backend

    fast = Backend("hosted_vllm/qwen3-8b", api_base="http://127.0.0.1:8001/v1")
    slow = Backend("hosted_vllm/qwen3-32b", api_base="http://127.0.0.1:8002/v1", window=131072)
    with Session(fast=fast, slow=slow, tenant="acme") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)

``import agentkv`` is cheap: every name loads on first use, and litellm, torch and transformers are imported
where they are used.
"""

from typing import TYPE_CHECKING

from agentkv._support.lazy import lazy_exports

if TYPE_CHECKING:
    from agentkv.http.transport import HttpError as HttpError
    from agentkv.http.transport import HttpTransport as HttpTransport
    from agentkv._session import Attempt as Attempt
    from agentkv._session import Observation as Observation
    from agentkv._session import Session as Session
    from agentkv._session import TurnEnd as TurnEnd
    from agentkv.backends import Backend as Backend
    from agentkv.conversations import Conversations as Conversations
    from agentkv.discovery import WindowDiscovery as WindowDiscovery
    from agentkv.errors import AgentKVError as AgentKVError
    from agentkv.errors import ConfigurationError as ConfigurationError
    from agentkv.errors import ContextOverflowError as ContextOverflowError
    from agentkv.errors import InvalidRequestError as InvalidRequestError
    from agentkv.errors import PoolExhaustedError as PoolExhaustedError
    from agentkv.handoff.escalation import Handoff as Handoff
    from agentkv.prefix import PrefixReport as PrefixReport
    from agentkv.protocols import CompletionClient as CompletionClient
    from agentkv.protocols import SessionLike as SessionLike
    from agentkv.react import RunResult as RunResult
    from agentkv.react import Tool as Tool
    from agentkv.retry import RetryPolicy as RetryPolicy
    from agentkv.routing import RouteDecision as RouteDecision
    from agentkv.routing import RoutePolicy as RoutePolicy
    from agentkv.stats import LedgerEntry as LedgerEntry
    from agentkv.tokens import TokenCount as TokenCount
    from agentkv.toolschema import function_schema as function_schema
    from agentkv.warm import WarmAheadPolicy as WarmAheadPolicy
    from agentkv.tenancy import derive_cache_salt as derive_cache_salt
    from agentkv.decorator import NoSessionError as NoSessionError
    from agentkv.decorator import acompletion as acompletion
    from agentkv.decorator import completion as completion
    from agentkv.decorator import configure as configure
    from agentkv.decorator import current_session as current_session
    from agentkv.decorator import session as session

# Every name loads on first use (PEP 562): ``import agentkv`` costs next to nothing, and a program pays for the parts
# it touches (``from agentkv import Backend`` does not import the Session; ``from agentkv import Session`` imports
# neither the gateway nor torch). These are exactly the names of ``__all__`` (a test pins it); the pure core
# (decide_route, plan_recovery, parse_overflow, decide_warm, ...) is imported from its own modules.
_EXPORTS = {
    "HttpError": "agentkv.http.transport",
    "HttpTransport": "agentkv.http.transport",
    "Attempt": "agentkv._session",
    "Observation": "agentkv._session",
    "Session": "agentkv._session",
    "TurnEnd": "agentkv._session",
    "Backend": "agentkv.backends",
    "Conversations": "agentkv.conversations",
    "WindowDiscovery": "agentkv.discovery",
    "AgentKVError": "agentkv.errors",
    "ConfigurationError": "agentkv.errors",
    "ContextOverflowError": "agentkv.errors",
    "PoolExhaustedError": "agentkv.errors",
    "InvalidRequestError": "agentkv.errors",
    "Handoff": "agentkv.handoff.escalation",
    "PrefixReport": "agentkv.prefix",
    "CompletionClient": "agentkv.protocols",
    "SessionLike": "agentkv.protocols",
    "RunResult": "agentkv.react",
    "Tool": "agentkv.react",
    "RetryPolicy": "agentkv.retry",
    "RouteDecision": "agentkv.routing",
    "RoutePolicy": "agentkv.routing",
    "LedgerEntry": "agentkv.stats",
    "TokenCount": "agentkv.tokens",
    "function_schema": "agentkv.toolschema",
    "WarmAheadPolicy": "agentkv.warm",
    "derive_cache_salt": "agentkv.tenancy",
    "NoSessionError": "agentkv.decorator",
    "acompletion": "agentkv.decorator",
    "completion": "agentkv.decorator",
    "configure": "agentkv.decorator",
    "current_session": "agentkv.decorator",
    "session": "agentkv.decorator",
}

__version__ = "0.1.0"

# The user API: exactly the names of _EXPORTS (``agentkv.__version__`` is an attribute, not an export).
__all__ = [
    "AgentKVError",
    "Attempt",
    "Backend",
    "CompletionClient",
    "ConfigurationError",
    "ContextOverflowError",
    "Conversations",
    "Handoff",
    "HttpError",
    "HttpTransport",
    "InvalidRequestError",
    "LedgerEntry",
    "NoSessionError",
    "PoolExhaustedError",
    "Observation",
    "PrefixReport",
    "RetryPolicy",
    "RouteDecision",
    "RoutePolicy",
    "RunResult",
    "Session",
    "SessionLike",
    "TokenCount",
    "Tool",
    "TurnEnd",
    "WarmAheadPolicy",
    "WindowDiscovery",
    "acompletion",
    "completion",
    "configure",
    "current_session",
    "derive_cache_salt",
    "function_schema",
    "session",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
