"""What the gateway answers besides a backend's bytes: OpenAI's error shape, and the route headers.

OpenAI's error shape is ``{"error": {"message", "type", "param", "code"}}``; an upstream error already in it
passes as it is, vLLM's older top-level shape (``{"object": "error", "message", ...}``) is nested, and
anything else (an HTML page from a proxy) becomes the message, cut short.
"""

from __future__ import annotations

import json
from typing import Any

from agentkv.routing import RouteDecision

__all__ = ["BACKEND_HEADER", "ROUTE_HEADER", "error_body", "route_headers", "upstream_error_body"]

BACKEND_HEADER = "x-agentkv-backend"
ROUTE_HEADER = "x-agentkv-route"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 502: "upstream_error", 503: "upstream_error",
          504: "upstream_error"}


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: Any = None) -> bytes:
    """OpenAI's error JSON for an answer the gateway makes itself."""
    error = {"message": message, "type": type or _TYPES.get(status, "api_error"), "param": param,
             "code": code if code is not None else status}
    return json.dumps({"error": error}).encode()


def upstream_error_body(status: int, raw: bytes) -> bytes:
    """A backend's error answer in OpenAI's shape (unchanged when it already is)."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return raw
    if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        return error_body(status, parsed["message"], type=parsed.get("type") if isinstance(parsed.get("type"), str)
                          else None, param=parsed.get("param"), code=parsed.get("code"))
    text = raw.decode("utf-8", "replace").strip()[:2000] or f"the backend answered HTTP {status}"
    return error_body(status, text)


def route_headers(decision: RouteDecision) -> dict[str, str]:
    """The headers of an answer a backend produced: which one, and the final route's reason."""
    return {BACKEND_HEADER: decision.role, ROUTE_HEADER: decision.reason}
