"""What a Session's drivers gather before deciding, and the checks of what a caller hands them.

:class:`Facts` is everything routing and warm-ahead need from I/O (windows, served models); a driver
builds it with :func:`to_facts` from the :class:`~agentkv.backends.WindowInfo` it gathered its own way
(the async driver awaits). The checks raise before any count or network call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from agentkv.backends import Backend, WindowInfo
from agentkv.errors import ConfigurationError
from agentkv.routing import Target, no_slow_target, slow_target

__all__ = ["Facts", "check_backends", "check_timeout", "max_tokens_of", "to_facts"]


@dataclass(frozen=True)
class Facts:
    """What routing and warm-ahead need from I/O, gathered by a driver before any decision."""

    fast: Target
    slow: Target
    slow_model_known: bool


def to_facts(fast: Backend, slow: Backend | None, fast_info: WindowInfo, slow_info: WindowInfo | None) -> Facts:
    """The routing targets of a Session's backends, the cloud-catalog rule applied to slow."""
    fast_target = Target(fast.label, fast_info.window)
    if slow is None or slow_info is None:
        return Facts(fast_target, no_slow_target(), False)
    target = slow_target(slow.label, slow_info.window, is_cloud=slow.is_cloud, in_catalog=bool(slow_info.model_known),
                         model=slow.model)
    return Facts(fast_target, target, bool(slow_info.model_known))


def max_tokens_of(kwargs: Mapping[str, Any]) -> int | None:
    """The output budget the server will obey: ``max_completion_tokens``, else ``max_tokens`` (as vLLM).

    Raises ``ValueError`` naming the key when either is set to anything but a positive int.
    """
    for key in ("max_completion_tokens", "max_tokens"):
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    value = kwargs.get("max_completion_tokens")
    return kwargs.get("max_tokens") if value is None else value


def check_backends(fast: Any, slow: Any) -> None:
    """Raise :class:`ConfigurationError` unless ``fast`` (and ``slow``, if given) are distinct Backends."""
    if not isinstance(fast, Backend):
        raise ConfigurationError(f"Session(fast=...) must be a Backend, got {type(fast).__name__}")
    if slow is not None and not isinstance(slow, Backend):
        raise ConfigurationError(f"Session(slow=...) must be a Backend or None, got {type(slow).__name__}")
    if slow is not None and slow.label == fast.label:
        raise ConfigurationError(f"fast and slow backends need distinct names; both are {fast.label!r}")


def check_timeout(value: float | None) -> float | None:
    """``value`` when it is a positive number or None, else :class:`ConfigurationError`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ConfigurationError(f"Session(request_timeout_s=...) must be a positive number or None, got {value!r}")
    return value
