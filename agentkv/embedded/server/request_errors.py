"""The errors a request can be refused with, shaped as vLLM 0.32 sends them.

Two kinds, as in vLLM:

- :class:`RequestError`: a check of vLLM's serving layer or of its request validators (``VLLMValidationError``):
  type ``BadRequestError`` (or ``NotFoundError``...), ``param`` the parameter, the message ``... (parameter=P,
  value=V)``;
- :func:`validation_error`: a body that does not fit the request schema, as FastAPI's ``RequestValidationError``
  reaches vLLM's ``validation_exception_handler``: type ``"Bad Request"``, ``param`` the first error's location
  (``body.messages``, ``body.max_tokens``...), message ``"N validation errors:\\n  {...}"`` with at most 10
  entries, each input summarised (``'<dict of 2 items>'``), never echoed whole.

A body whose JSON nests too deep to parse is FastAPI's plain ``{"detail": "There was an error parsing the body"}``
(:data:`UNPARSABLE_BODY`).

Usage::

    raise RequestError("Prompt cannot be empty.", param="prompt")
    raise validation_error([{"type": "missing", "loc": ("body", "messages"), "msg": "Field required",
                             "input": body}])
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from agentkv.embedded.engine.limits import error_body

__all__ = ["UNPARSABLE_BODY", "ParamError", "RequestError", "clean_loc", "validation_error"]

UNPARSABLE_BODY = {"detail": "There was an error parsing the body"}
"""FastAPI's answer (400) to a body its JSON parser gives up on, e.g. nesting past the recursion limit."""

_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_BRACKETED = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype",
})
"""pydantic-core's schema-kind names that appear in an error's ``loc`` but name no field (vLLM's list)."""


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with vLLM's error JSON (``body``)."""

    def __init__(self, message: str, *, status: int = 400, type: str = "BadRequestError",
                 param: str | None = None, body: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = dict(body) if body is not None else error_body(message, type=type, param=param, code=status)


class ParamError(ValueError):
    """A field vLLM rejects (its ``VLLMValidationError``): the message names the parameter and value."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter, self.value = parameter, value

    def __str__(self) -> str:
        extras = [f"{k}={v}" for k, v in (("parameter", self.parameter), ("value", self.value)) if v is not None]
        base = super().__str__()
        return f"{base} ({', '.join(extras)})" if extras else base


def clean_loc(loc: Sequence[Any]) -> str:
    """A pydantic ``loc`` as vLLM's dotted ``param``: ``("body", "stop", "list[str]")`` -> ``"body.stop"``."""
    parts = [str(p) for p in loc if not _is_internal(str(p))]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _is_internal(segment: str) -> bool:
    return bool(_BRACKETED.search(segment)) or segment.lower() in _INTERNAL_LOC_MARKERS


def _summarise(value: Any) -> Any:
    """A size-bounded stand-in for an error's ``input``: containers are described, long text cut."""
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def _format(error: Mapping[str, Any] | str) -> str:
    if not isinstance(error, Mapping):
        return str(error)
    shown = dict(error)
    if "input" in shown:
        shown["input"] = _summarise(shown["input"])
    if isinstance(shown.get("loc"), (tuple, list)):
        shown["loc"] = clean_loc(shown["loc"])
    text = str(shown)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def validation_error(errors: Sequence[Mapping[str, Any] | str]) -> RequestError:
    """vLLM's answer to a body that fails the schema; each error's ``loc`` starts with ``"body"``."""
    first = errors[0] if errors else None
    loc = first.get("loc") if isinstance(first, Mapping) else None
    param = clean_loc(loc) if loc else None
    if errors:
        label = "error" if len(errors) == 1 else "errors"
        reported = errors[:_MAX_REPORTED_ERRORS]
        message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format(e)}\n" for e in reported)
        if len(errors) > len(reported):
            message += f"  ...and {len(errors) - len(reported)} more {label}\n"
        message = message.rstrip()
    else:
        message = "Validation error"
    return RequestError(message, type="Bad Request", param=param)
