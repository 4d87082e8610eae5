"""Transient-error retries (429, 5xx, timeouts, connection errors) with tenacity.

Bounded attempts, exponential backoff with jitter, an injectable sleep. No other 4xx is retried, and
a context overflow is never "transient": the Session's overflow path handles it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

from agentkv.errors import check_positive_int
from agentkv.events import emit

T = TypeVar("T")

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
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & _TRANSIENT_NAMES) or isinstance(error, (TimeoutError, ConnectionError))


_OUTAGE_NAMES = {"APIConnectionError", "ConnectError", "ConnectTimeout", "ServiceUnavailableError", "BadGatewayError"}


def is_outage(error: BaseException) -> bool:
    """True when the backend could not be reached or said it is unavailable (connection errors, 502, 503,
    504): the request itself was not at fault, so another backend may take it."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _OUTAGE_NAMES or isinstance(error, ConnectionError):
        return True
    return getattr(error, "status_code", None) in (502, 503, 504)


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried.

        RetryPolicy(attempts=3, initial_s=0.5, max_s=8.0)   # sleep= and asleep= are injectable
    """

    attempts: int = 3
    initial_s: float = 0.5
    max_s: float = 8.0
    jitter_s: float = 0.5
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    asleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False)

    def __post_init__(self) -> None:
        check_positive_int("RetryPolicy", "attempts", self.attempts)

    def _kwargs(self) -> dict[str, Any]:
        from tenacity import retry_if_exception, stop_after_attempt, wait_exponential_jitter

        return dict(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=self.initial_s, max=self.max_s, jitter=self.jitter_s),
            retry=retry_if_exception(is_transient),
            reraise=True,
            before_sleep=_log_retry,
        )

    def call(self, fn: Callable[[], T]) -> T:
        """Call ``fn``, retrying transient errors."""
        from tenacity import Retrying

        return Retrying(sleep=self.sleep, **self._kwargs())(fn)

    async def acall(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Await ``fn()``, retrying transient errors."""
        from tenacity import AsyncRetrying

        async def attempt() -> T:  # tenacity awaits only coroutine functions
            return await fn()

        return await AsyncRetrying(sleep=self.asleep, **self._kwargs())(attempt)


def _log_retry(state: Any) -> None:
    error = state.outcome.exception() if state.outcome else None
    emit("transient_retry", level="warning", attempt=state.attempt_number,
         error=type(error).__name__ if error else None, sleep_s=round(state.next_action.sleep, 3))
