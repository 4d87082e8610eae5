"""agentkv: fast/slow model routing for agents that never loses a turn at the moment of escalation.

    from agentkv import Session, Backend

    fast = Backend("hosted_vllm/qwen3-8b", api_base="http://127.0.0.1:8001/v1")
    slow = Backend("hosted_vllm/qwen3-32b", api_base="http://127.0.0.1:8002/v1", window=131072)
    with Session(fast=fast, slow=slow, tenant="acme") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)

``import agentkv`` is cheap: litellm, torch and transformers are imported where they are used.
"""

from agentkv._http import HttpError, HttpTransport
from agentkv._session import Attempt, Observation, Session, TurnEnd
from agentkv.backends import Backend
from agentkv.discovery import WindowDiscovery
from agentkv.errors import AgentKVError, ConfigurationError, ContextOverflowError, InvalidRequestError
from agentkv.handoff.escalation import Handoff
from agentkv.prefix import PrefixReport
from agentkv.protocols import CompletionClient, SessionLike
from agentkv.react import RunResult, Tool
from agentkv.retry import RetryPolicy
from agentkv.routing import RouteDecision, RoutePolicy
from agentkv.stats import LedgerEntry
from agentkv.tokens import TokenCount
from agentkv.toolschema import function_schema
from agentkv.warm import WarmAheadPolicy

# The pure core and its value types, exported by their own modules and kept importable from here for code
# written before (not in __all__: import them from agentkv.routing, .overflow, .warm, .tokens, .tenancy, ...).
from agentkv.backends import WindowInfo as WindowInfo  # noqa: E402
from agentkv.discovery import default_discovery as default_discovery  # noqa: E402
from agentkv.overflow import Overflow as Overflow, overflow_from_error as overflow_from_error  # noqa: E402
from agentkv.overflow import parse_overflow as parse_overflow  # noqa: E402
from agentkv.routing import Recovery as Recovery, decide_route as decide_route  # noqa: E402
from agentkv.routing import plan_recovery as plan_recovery  # noqa: E402
from agentkv.tenancy import derive_cache_salt as derive_cache_salt  # noqa: E402
from agentkv.tokens import Payload as Payload, TokenCounter as TokenCounter  # noqa: E402
from agentkv.tokens import payload_from_request as payload_from_request  # noqa: E402
from agentkv.warm import CooldownMap as CooldownMap, WarmDecision as WarmDecision  # noqa: E402
from agentkv.warm import decide_warm as decide_warm  # noqa: E402

# Bound last: ``agentkv.session`` is the decorator (the Session class lives in ``agentkv._session``).
from agentkv.decorator import (  # noqa: E402
    NoSessionError, acompletion, completion, configure, current_session, session,
)

__version__ = "0.1.0"

# The user API.
__all__ = [
    "AgentKVError",
    "Attempt",
    "Backend",
    "CompletionClient",
    "ConfigurationError",
    "ContextOverflowError",
    "Handoff",
    "HttpError",
    "HttpTransport",
    "InvalidRequestError",
    "LedgerEntry",
    "NoSessionError",
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
    "__version__",
    "acompletion",
    "completion",
    "configure",
    "current_session",
    "function_schema",
    "session",
]
