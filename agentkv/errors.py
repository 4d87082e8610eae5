"""agentkv's exceptions."""

from __future__ import annotations


class AgentKVError(Exception):
    """Base class of agentkv's own errors."""


class ConfigurationError(AgentKVError, ValueError):
    """A Backend, Session or policy was configured with a value that cannot work."""


class InvalidRequestError(AgentKVError, ValueError):
    """A request as the caller passed it cannot be sent (a malformed message, a ``cache_salt`` vLLM refuses).

    Raised before any count or network call; the message names the place and the problem, never a secret.

    ``index`` is the malformed message's position in ``messages`` (None when the list itself is at fault) and
    ``field`` the field at fault (``"role"``, ``"content[1].text"``, ``"tool_calls[0].function.name"``), so a
    caller can point at what to fix:

        InvalidRequestError: messages[2].role is missing: every message needs a string role
    """

    def __init__(self, message: str, *, index: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.field = field


class ContextOverflowError(AgentKVError):
    """A request fits no configured backend, or a guard stopped it before it was sent.

    Attributes name what was counted and where it would have gone, so a caller can act on it.
    """

    def __init__(
        self,
        message: str,
        *,
        input_tokens: int,
        windows: dict[str, int | None],
        max_tokens: int | None = None,
        suggested_backend: str | None = None,
    ) -> None:
        super().__init__(message)
        self.input_tokens = input_tokens
        self.windows = dict(windows)
        self.max_tokens = max_tokens
        self.suggested_backend = suggested_backend


class PoolExhaustedError(AgentKVError):
    """No replica of a pool (``Backend(api_base=[...])``) could take a turn, and no other backend took it.

    ``pool`` is the pool's label, ``replicas`` each replica's URL (credentials and query string removed) and what
    happened to it this turn ("refused", "unavailable (504)", "ejected (cooling off 28 s)", "not tried"); the last
    try's error is the ``__cause__``:

        PoolExhaustedError: pool 'slow' exhausted: http://h1/v1 refused, http://h2/v1 ejected (cooling off 28 s)
    """

    def __init__(self, pool: str, replicas: dict[str, str]) -> None:
        shown = ", ".join(f"{url} {state}" for url, state in replicas.items())
        super().__init__(f"pool {pool!r} exhausted: {shown}")
        self.pool = pool
        self.replicas = dict(replicas)


class AnswerTooLarge(AgentKVError):
    """A backend's answer grew past the bound its reader was given (``limit`` bytes): not an outage and not
    transient, so it is neither retried nor failed over (a second try would generate it again)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the backend's answer is over {limit} bytes")
        self.limit = limit


def check_positive_int(owner: str, name: str, value: object) -> None:
    """Raise :class:`ConfigurationError` naming ``owner.name`` unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{owner}.{name} must be an int >= 1, got {value!r}")
