"""Transient-error retries (429, 5xx, timeouts, connection errors), decided as tenacity's ``iter`` decides, and what
counts as an outage.

Bounded attempts, exponential backoff with jitter, an injectable sleep: :meth:`RetryPolicy.retry_after` says whether
and after how long a failed try is tried again, and the turn waits that long (a ``Wait`` effect). No other 4xx is
retried, and a context overflow is never "transient": the Session's overflow path handles it.

An outage (the backend could not be reached, or said it is unavailable) is decided from the error's
cause, not from the class a client wrapped it in: litellm reports a refused connection to ``hosted_vllm``
as ``InternalServerError`` (status 500), the OpenAI SDK as ``APIConnectionError``, httpx as ``ConnectError``;
:func:`outage_cause` walks the chain (``__cause__`` and ``__context__``) to the socket error, its errno, or
the httpx/httpcore/aiohttp/h11 class that says what happened.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal, TypeVar

from agentkv.errors import ConfigurationError, check_positive_int
from agentkv.events import emit

__all__ = ["CLIENT_RETRIES_OFF", "Outage", "RetryPolicy", "TurnTries", "is_outage", "is_transient", "outage_cause",
           "log_retry", "replica_evidence", "replica_state"]

T = TypeVar("T")

Outage = Literal["refused", "unreachable", "dropped", "incomplete", "unavailable", "timeout"]

# What a completion client is told so that its own retries never multiply the policy's: litellm's
# ``num_retries`` (its retry wrapper) and ``max_retries`` (the OpenAI SDK client litellm builds).
CLIENT_RETRIES_OFF: dict[str, int] = {"num_retries": 0, "max_retries": 0}

_ERRNOS: dict[int, Outage] = {
    errno.ECONNREFUSED: "refused",
    errno.ECONNRESET: "dropped", errno.ECONNABORTED: "dropped", errno.EPIPE: "dropped", errno.ESHUTDOWN: "dropped",
    errno.EHOSTUNREACH: "unreachable", errno.ENETUNREACH: "unreachable", errno.EHOSTDOWN: "unreachable",
    errno.ENETDOWN: "unreachable", errno.ETIMEDOUT: "unreachable",
}

# The classes (by name, anywhere in a link's MRO, nearest first) of the libraries under the clients that say
# how a connection failed: httpx/httpcore/h11 (sync litellm, the OpenAI SDK, raw httpx), aiohttp (async litellm),
# urllib3/requests and http.client. Wrapper classes (``InternalServerError``, ``APIConnectionError``) are not here.
_CAUSE_NAMES: dict[str, Outage] = {
    "ConnectError": "unreachable", "ConnectTimeout": "unreachable", "ClientConnectorError": "unreachable",
    "NewConnectionError": "unreachable", "ConnectionTimeoutError": "unreachable", "NameResolutionError": "unreachable",
    "RemoteProtocolError": "dropped", "ReadError": "dropped", "WriteError": "dropped",
    "ServerDisconnectedError": "dropped", "ClientConnectionResetError": "dropped",
    "ClientPayloadError": "incomplete", "IncompleteRead": "incomplete", "ContentLengthError": "incomplete",
    "TransferEncodingError": "incomplete", "ChunkedEncodingError": "incomplete",
    "ReadTimeout": "timeout", "WriteTimeout": "timeout", "SocketTimeoutError": "timeout",
    "ServerTimeoutError": "timeout", "TimeoutError": "timeout",
}
_STATUS_OUTAGES = (502, 503, 504)
_CHAIN_LIMIT = 32


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception behind it (``__cause__`` and ``__context__``), outermost first."""
    seen: list[BaseException] = []
    todo = [error]
    while todo and len(seen) < _CHAIN_LIMIT:
        link = todo.pop(0)
        if any(link is s for s in seen):
            continue
        seen.append(link)
        todo += [e for e in (link.__cause__, link.__context__) if e is not None]
    return seen


def _link_cause(link: BaseException) -> Outage | None:
    from typing import get_args

    from agentkv.http.transport import HttpError  # the seam's one error: its kind (and how, when it knows)

    if isinstance(link, HttpError):  # an outage or a timeout; a status is read below, from its status_code
        reason = link.reason or {"outage": "dropped", "timeout": "timeout"}.get(link.kind)
        return next((o for o in get_args(Outage) if o == reason), None)
    if isinstance(link, ConnectionRefusedError):
        return "refused"
    if isinstance(link, socket.gaierror):
        return "unreachable"
    if isinstance(link, OSError) and not isinstance(link, TimeoutError) and link.errno in _ERRNOS:
        return _ERRNOS[link.errno]
    if isinstance(link, ConnectionError):
        return "dropped"
    for cls in type(link).__mro__:
        if cls.__name__ in _CAUSE_NAMES:
            return _CAUSE_NAMES[cls.__name__]
    return None


def outage_cause(error: BaseException) -> Outage | None:
    """How ``error`` shows its backend unreachable, or None when it does not.

    "refused", "unreachable" (DNS, no route, connect timeout), "dropped" (reset, closed without an answer),
    "incomplete" (closed mid-answer): the innermost such cause in the chain; else "unavailable" for a 502, 503
    or 504 status on any link; else "timeout" for a read or write timeout. An error that delivered part of
    an answer (``partial_answer = True``, a stream broken after its first bytes) is never an outage.
    """
    links = _chain(error)
    if any(getattr(link, "partial_answer", False) is True for link in links):
        return None
    causes = [c for c in map(_link_cause, links) if c is not None]
    connection = [c for c in causes if c != "timeout"]
    if connection:
        return connection[-1]
    if any(getattr(link, "status_code", None) in _STATUS_OUTAGES for link in links):
        return "unavailable"
    return "timeout" if causes else None


def is_outage(error: BaseException, *, timeouts: bool = False) -> bool:
    """True when the backend could not be reached or said it is unavailable (see :func:`outage_cause`): the
    request itself was not at fault, so another backend may take it. A read timeout counts only with
    ``timeouts=True`` (a slow answer is not a dead server unless the policy says so)."""
    cause = outage_cause(error)
    return cause is not None and (timeouts or cause != "timeout")


_RESET_NAMES = {"ConnectionResetError", "ClientConnectionResetError"}


def _reset(link: BaseException) -> bool:
    return isinstance(link, ConnectionResetError) or (isinstance(link, OSError) and link.errno == errno.ECONNRESET) \
        or any(cls.__name__ in _RESET_NAMES for cls in type(link).__mro__)


def replica_evidence(error: BaseException, *, fails_over: bool) -> Literal["down", "failed"] | None:
    """What ``error`` says about the server a try went to (:mod:`agentkv.fleet.breaker` weighs it): "down" when it
    refused, could not be reached, or reset the connection (the server's own failure, whatever was sent); "failed"
    for any other error that ``fails_over`` (a 502/503/504, a connection closed without an answer, a timeout the
    policy fails over: this request's failure, unless it repeats across conversations); None for the rest (an
    answer, even an error one, says the server is up)."""
    cause = outage_cause(error)
    if cause in ("refused", "unreachable") or (cause == "dropped" and any(map(_reset, _chain(error)))):
        return "down"
    return "failed" if fails_over else None


def replica_state(error: BaseException) -> str:
    """How a try failed, in a few words for an operator ("refused", "unavailable (504)", "timeout"): the cause and
    the status code, never the server's text."""
    cause = outage_cause(error)
    if cause != "unavailable":  # a connection's failure: a wrapper's status code (litellm's 500) would mislead
        return cause or "failed"
    status = next(code for code in (getattr(link, "status_code", None) for link in _chain(error))
                  if code in _STATUS_OUTAGES)
    return f"unavailable ({status})"


_TRANSIENT_NAMES = {
    "RateLimitError", "InternalServerError", "ServiceUnavailableError", "APIConnectionError",
    "Timeout", "APITimeoutError", "TimeoutException", "ConnectError", "ReadTimeout", "ConnectTimeout",
    "RemoteProtocolError", "BadGatewayError",
}


def is_transient(error: BaseException) -> bool:
    """True for 408, 429, 5xx, timeouts and connection errors; False for every other error."""
    code = getattr(error, "status_code", None)
    if isinstance(code, int):
        return code in (408, 429) or code >= 500
    if getattr(error, "partial_answer", False) is True:
        return False
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & _TRANSIENT_NAMES) or isinstance(error, (TimeoutError, ConnectionError)) \
        or outage_cause(error) is not None


@dataclass
class TurnTries:
    """What one turn (one caller request, through every retry, clamp, escalation and failover) has sent so far.

    ``sent``: tries per role ("fast", "slow"); ``down``: roles found down this turn; ``refused``: roles that
    refused this request as too long. The reactive path closes a backend for the rest of the turn once it
    is down, refused it, or has had :attr:`RetryPolicy.attempts` tries, so a turn sends at most that many
    tries to each backend (plus one warm), and never the same payload to a backend found down.
    """

    sent: Counter[str] = field(default_factory=Counter)
    down: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    streamed: bool = False
    recoveries: int = 0  # overflows this turn recovered from (clamped or escalated)
    failovers: int = 0  # outages this turn failed over from
    replicas_down: set[str] = field(default_factory=set)  # a pool's replicas that failed this turn (never tried again)
    replica_failures: dict[str, str] = field(default_factory=dict)  # each such replica: how (:func:`replica_state`)

    def left(self, role: str, attempts: int) -> int:
        """Tries ``role`` may still have this turn."""
        return max(0, attempts - self.sent[role])

    def closed(self, role: str, attempts: int, *, refusal_closes: bool = True) -> str:
        """Why ``role`` takes no more of this turn ("" when it may). ``refusal_closes=False``: a refusal as too long
        does not close it (a recovery's clamp retries the backend that refused, with less output)."""
        if role in self.down:
            return "is down this turn"
        if refusal_closes and role in self.refused:
            return "refused this request as too long"
        if not self.left(role, attempts):
            return f"has had its {attempts} tries this turn"
        return ""


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried, and which errors fail over.

    ``timeout_fails_over``: a read timeout on a non-streamed request counts as an outage (the turn fails over
    to the other backend after the retries); off by default, since a long answer is not a dead server.
    ``retry_transient=False``: each try is sent once, and a transient error goes straight to the turn's next step
    (an outage fails over at once; a 429 or 5xx is the answer): for a proxy whose own clients retry, as the gateway's
    do. ``attempts`` still bounds the tries each backend gets in a turn (a clamp's retry is one).
    ``replica_cooloff_s``: how long a replica of a pool (``Backend(api_base=[…])``) is left out once ejected; its
    conversations go to their next replica meanwhile. An outage on a replica is never retried on it: the turn goes to
    the next replica, and the replica is ejected only on evidence that it is failing (it refused or reset a
    connection, or failed tries of several conversations in a row: :mod:`agentkv.fleet.breaker`).

        RetryPolicy(attempts=3, initial_s=0.5, max_s=8.0)   # sleep= and asleep= are injectable
    """

    attempts: int = 3
    initial_s: float = 0.5
    max_s: float = 8.0
    jitter_s: float = 0.5
    timeout_fails_over: bool = False
    retry_transient: bool = True
    replica_cooloff_s: float = 30.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    asleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False)

    def __post_init__(self) -> None:
        check_positive_int("RetryPolicy", "attempts", self.attempts)
        cooloff = self.replica_cooloff_s
        if isinstance(cooloff, bool) or not isinstance(cooloff, (int, float)) or not cooloff > 0:
            raise ConfigurationError(f"RetryPolicy.replica_cooloff_s must be a positive number, got {cooloff!r}")

    def fails_over(self, error: BaseException, *, streamed: bool = False) -> bool:
        """True when ``error`` is an outage under this policy (see :func:`is_outage`)."""
        return is_outage(error, timeouts=self.timeout_fails_over and not streamed)

    def limit(self, left: int | None = None) -> int:
        """How many tries one send gets: :attr:`attempts`, lowered to ``left`` (what a turn has left) when given, and
        1 when transient errors are not retried."""
        if not self.retry_transient:
            return 1
        return max(1, min(self.attempts, self.attempts if left is None else left))

    def retry_after(self, error: BaseException, *, tries: int, limit: int, outages: bool = True) -> float | None:
        """The wait before the same send's next try after its try number ``tries`` failed with ``error``, or None
        when it is not retried (as tenacity's ``iter`` decides, without sleeping or calling anything): only a
        transient error is retried (``outages=False``: not an outage, which a pool's next replica takes), and only
        while ``tries < limit``."""
        if tries >= limit:
            return None
        retried = is_transient(error) if outages else is_transient(error) and not self.fails_over(error)
        return self.backoff_s(tries) if retried else None

    def backoff_s(self, tries: int) -> float:
        """The wait before try ``tries + 1``: ``min(max_s, initial_s * 2**(tries - 1) + uniform(0, jitter_s))``
        (exponential with jitter)."""
        exp = self.initial_s * 2.0 ** (int(tries) - 1)
        return max(0.0, min(exp + random.uniform(0, self.jitter_s), self.max_s))


def log_retry(error: BaseException, *, tries: int, delay_s: float) -> None:
    """Report a transient error about to be retried after ``delay_s``."""
    emit("transient_retry", level="warning", attempt=tries, error=type(error).__name__, sleep_s=round(delay_s, 3))
