"""What a Session's drivers gather before deciding, and the checks of what a caller hands them.

:class:`Facts` is everything routing and warm-ahead need from I/O (windows, served models); a driver
builds it with :func:`to_facts` from the :class:`~agentkv.backends.WindowInfo` it gathered its own way
(the async driver awaits). The checks raise before any count or network call: :func:`request_payload`
reads a request's payload and refuses a malformed message list (:func:`check_messages`) with an
:class:`~agentkv.errors.InvalidRequestError` naming the message and the field, and a header no HTTP client can
send (:func:`check_headers`) with a :class:`~agentkv.errors.ConfigurationError` naming the header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from agentkv.http.transport import unsendable_header
from agentkv.backends import Backend, WindowInfo
from agentkv.errors import ConfigurationError, InvalidRequestError
from agentkv.routing import Target, no_slow_target, slow_target
from agentkv.tokens import Payload, TokenCounter, payload_from_request
from agentkv.tokens.content_format import references_field

__all__ = ["Facts", "check_backends", "check_headers", "check_messages", "check_timeout", "max_tokens_of", "request_payload",
           "to_facts", "tool_call_id_required"]


@dataclass(frozen=True)
class Facts:
    """What routing and warm-ahead need from I/O, gathered by a driver before any decision."""

    fast: Target
    slow: Target
    slow_model_known: bool
    down: frozenset[str] = frozenset()  # the pools' replicas cooling off after an outage (their URLs)
    homes: Mapping[str, str] = field(default_factory=dict)  # pool label -> this conversation's home replica


def to_facts(fast: Backend, slow: Backend | None, fast_info: WindowInfo, slow_info: WindowInfo | None,
             down: frozenset[str] = frozenset(), homes: Mapping[str, str] | None = None) -> Facts:
    """The routing targets of a Session's backends, the cloud-catalog rule applied to slow."""
    fast_target = Target(fast.label, fast_info.window)
    if slow is None or slow_info is None:
        return Facts(fast_target, no_slow_target(), False, down, homes or {})
    target = slow_target(slow.label, slow_info.window, is_cloud=slow.is_cloud, in_catalog=bool(slow_info.model_known),
                         model=slow.model)
    return Facts(fast_target, target, bool(slow_info.model_known), down, homes or {})


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


def check_headers(headers: Any, where: str) -> None:
    """Raise :class:`ConfigurationError` naming the header (never its value) when one of ``headers`` cannot be sent:
    CR, LF, NUL or non-ASCII characters in its name or value (a client would fail it on every try)."""
    bad = unsendable_header(headers)
    if bad is not None:
        raise ConfigurationError(f"{where}: header '{bad}' cannot be sent: a header name must be an HTTP token and "
                                 "its value printable ASCII (no CR, LF, NUL or non-ASCII characters)")


def request_payload(kwargs: Mapping[str, Any], backends: Sequence[Backend], counters: Iterable[TokenCounter]) -> Payload:
    """The request's payload (:func:`~agentkv.tokens.payload_from_request`), its messages checked for every
    backend the Session may send them to (``counters`` say which chat templates those render with), and its
    ``extra_headers`` and ``headers`` checked (:func:`check_headers`)."""
    for key in ("extra_headers", "headers"):
        check_headers(kwargs.get(key), key)
    payload = payload_from_request(kwargs)
    if payload.messages is not None:
        templates = [counter.chat_template for counter in counters]
        check_messages(payload.messages, tool_call_id_required=tool_call_id_required(backends, templates))
    return payload


def tool_call_id_required(backends: Sequence[Backend], templates: Iterable[str | None]) -> bool:
    """Whether a tool message must name the call it answers: when a backend is a cloud API (OpenAI's and
    Anthropic's refuse a tool message without ``tool_call_id``) or a backend's known chat template reads
    ``tool_call_id``. The built-in templates do not; a server's own template, when none is declared, is not
    known and not assumed to."""
    return any(b.is_cloud for b in backends) or any(
        t is not None and references_field(t, "tool_call_id") for t in templates)


# content-part types whose text a template reads, and the key it is under
_PART_TEXT = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def check_messages(messages: Any, *, tool_call_id_required: bool = False) -> None:
    """Raise :class:`~agentkv.errors.InvalidRequestError` at the first malformed message, naming its index and
    field. A well-formed list is non-empty and each message an object (a dict, or a message object such as
    litellm's) with

    - ``role``: a string;
    - ``content``: a string, or a list of content-part objects, each with a string ``type`` (a ``text``
      part with a string ``text``, a ``refusal`` part a string ``refusal``; ``text``, where present, a string);
      null or absent only in an assistant message;
    - ``tool_calls``: null, absent or a list of calls, each an object whose ``function`` has a string
      ``name`` and ``arguments`` that are a JSON string or an object;
    - ``tool_call_id`` and ``name``: strings where set; a ``tool`` message needs a non-empty ``tool_call_id``
      when ``tool_call_id_required`` (:func:`tool_call_id_required`).

    These are the shapes vLLM's request model refuses with a 400 (or its chat templates fail on), checked
    here so that the caller learns which message is wrong before anything is counted or sent.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError(f"'messages' must be a list of messages, got {type(messages).__name__}",
                                  field="messages")
    if not messages:
        raise InvalidRequestError("'messages' is empty: a chat request needs at least one message", field="messages")
    for index, message in enumerate(messages):
        _check_message(index, message, tool_call_id_required)


def _check_message(index: int, message: Any, tool_call_id_required: bool) -> None:
    fields = message if type(message) is dict else _fields(message)
    if fields is None:
        raise InvalidRequestError(f"messages[{index}] must be a message object, got {type(message).__name__}",
                                  index=index)
    role = fields.get("role")
    if not isinstance(role, str):
        raise _invalid(index, "role", "is missing: every message needs a string role" if role is None
                       else f"must be a string, got {type(role).__name__}")
    _check_content(index, role, fields.get("content"))
    calls = fields.get("tool_calls")
    if calls is not None:
        _check_tool_calls(index, calls)
    for key in ("tool_call_id", "name"):
        value = fields.get(key)
        if value is not None and type(value) is not str and not isinstance(value, str):
            raise _invalid(index, key, f"must be a string, got {type(value).__name__}")
    if role == "tool" and tool_call_id_required and not fields.get("tool_call_id"):
        raise _invalid(index, "tool_call_id", "is missing: a backend this Session sends to needs each tool message "
                       "to name the call it answers")


def _check_content(index: int, role: str, content: Any) -> None:
    if type(content) is str:
        return
    if content is None:
        if role != "assistant":
            raise _invalid(index, "content", f"is null or missing: only an assistant message may have no content "
                           f"(this one is {role!r})")
        return
    if isinstance(content, str):
        return
    if isinstance(content, bytes) or not isinstance(content, Sequence):
        raise _invalid(index, "content", f"must be a string or a list of content parts, got {type(content).__name__}")
    for position, part in enumerate(content):
        fields = part if isinstance(part, Mapping) else None
        where = f"content[{position}]"
        if fields is None:
            raise _invalid(index, where, 'must be a content-part object such as {"type": "text", "text": "..."}, '
                           f"got {type(part).__name__}")
        kind = fields.get("type")
        if not isinstance(kind, str):
            raise _invalid(index, f"{where}.type", "must be a string" if kind is not None else "is missing")
        key = _PART_TEXT.get(kind)
        if key is not None and not isinstance(fields.get(key), str):
            raise _invalid(index, f"{where}.{key}", f"must be a string in a {kind!r} part")
        if "text" in fields and not isinstance(fields["text"], str):
            raise _invalid(index, f"{where}.text", f"must be a string, got {type(fields['text']).__name__}")


def _check_tool_calls(index: int, calls: Any) -> None:
    if type(calls) is not list and (isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence)):
        raise _invalid(index, "tool_calls", f"must be a list of tool calls, got {type(calls).__name__}")
    for position, call in enumerate(calls):
        fields = call if type(call) is dict else _fields(call)
        if fields is None:
            raise _invalid(index, f"tool_calls[{position}]", f"must be a tool-call object, got {type(call).__name__}")
        function = fields.get("function")
        function = function if type(function) is dict else _fields(function)
        if function is None:
            raise _invalid(index, f"tool_calls[{position}].function", "must be an object with a name and arguments")
        if not isinstance(function.get("name"), str):
            raise _invalid(index, f"tool_calls[{position}].function.name", "must be a string")
        if not isinstance(function.get("arguments"), (str, dict, Mapping)):
            raise _invalid(index, f"tool_calls[{position}].function.arguments", "must be a JSON string (or an object)")


def _fields(value: Any) -> Mapping[str, Any] | None:
    """A message (or tool call) as a mapping: a dict as it is, a pydantic message object (litellm's) dumped."""
    if isinstance(value, Mapping):
        return value
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        dumped = dump()
        return dumped if isinstance(dumped, Mapping) else None
    return None


def _invalid(index: int, field: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"messages[{index}].{field} {problem}", index=index, field=field)
