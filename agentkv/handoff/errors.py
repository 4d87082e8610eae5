"""Errors raised by KV handoff."""

from __future__ import annotations

from agentkv.errors import AgentKVError


class HandoffError(AgentKVError):
    """Base class of KV handoff errors."""


class SignatureMismatchError(HandoffError, ValueError):
    """A mapper was given a cache (or a model) that is not the one it was calibrated for."""


class UnknownMapperError(HandoffError, KeyError):
    """No mapper backend is registered under that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown mapper"


class NotMappableError(HandoffError, TypeError):
    """The backend moves no KV (``replay``): the handoff step must send the tokens instead."""


class MapperFileError(HandoffError, ValueError):
    """A mapper directory is missing, incomplete, or was written by another backend."""
