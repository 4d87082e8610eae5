"""litellm: a logger that accounts plain ``litellm.completion`` calls in a Session (observe-only).

    import litellm
    from agentkv.integrations.litellm import AgentKVLogger

    logger = AgentKVLogger(session)
    litellm.callbacks = [logger]
    litellm.completion(model="hosted_vllm/qwen3-8b", api_base=fast_url, messages=..., tools=...)
    session.ledger, session.stats()["cached_tokens_total"], logger.counters

Before each call addressed to the Session's fast backend, the logger counts it with
:meth:`Session.observe` (a ledger row; warm-ahead fires when due). When the call succeeds it records
the response's cached tokens; when it fails with a context overflow it counts that. A logger cannot
reroute or stop a call: litellm catches whatever a callback raises. To route, call
:meth:`Session.completion` instead.

What is accounted: calls whose model is the fast backend's (and whose ``api_base`` starts with its
``api_base``, when it has one), so the Session's own warm-ahead requests to the slow backend are
never counted as turns. Calls made *through* the Session are accounted by the Session already: do
not register a logger for a Session you also call directly. Several Sessions on one model can share
the process: tag each call with ``metadata={"agentkv_session": session.session_id}`` and a logger
skips calls tagged for another Session. (litellm copies a per-call ``callbacks=[...]`` into its
global lists, so per-call loggers do not isolate anything.)

litellm runs sync success callbacks on a background thread: :meth:`AgentKVLogger.wait` blocks until
a number of calls have finished, for tests and scripts that read the ledger right after a call.

To route, clamp, warm and recover calls made by code that only takes a litellm model string (smolagents'
``LiteLLMModel``, Google ADK's ``LiteLlm``, CrewAI...), register a provider instead:

    from agentkv.integrations.litellm import register

    register("agentkv", conversations)             # a Session, a Conversations, or a callable returning one
    litellm.completion(model="agentkv/fast", messages=..., tools=..., metadata={"session_id": "chat-42"})

Every call to ``agentkv/<alias>`` (``completion``, ``acompletion``, ``stream=True``) then runs through its
conversation's Session (:meth:`Session.completion`, with the call's own kwargs); the alias is not read. The
conversation is ``metadata["session_id"]``, ``["thread_id"]`` or ``["conversation_id"]`` (or litellm's
``litellm_session_id``) when the call names one, else its ``user``, else the digest of its opening (with a
:class:`~agentkv.Conversations`; a Session is one conversation). The answer is the backend's own
``ModelResponse``, its usage and cached tokens included; a stream ends with the backend's usage chunk (when the
caller asks for one with ``stream_options``: the Session always asks the backend). litellm's callbacks see the call
once, priced as the backend that answered: the Session's own litellm calls are sent with ``no-log``. agentkv's
errors reach the caller as litellm's (``ContextWindowExceededError``, ``BadRequestError``,
``ServiceUnavailableError``); the backends' errors keep their status.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import agentkv._support.env as _env
from agentkv.backends import Backend
from agentkv.conversations import session_of
from agentkv.errors import AnswerTooLarge, ContextOverflowError, InvalidRequestError, PoolExhaustedError
from agentkv.events import emit
from agentkv.protocols import SessionLike
from agentkv.overflow import overflow_from_error
from agentkv.wire.openai import OBSERVED_KEYS
from agentkv.wire.usage import first_finish_reason, report_rejected, response_usage

litellm = _env.import_litellm()  # cost map local and tiktoken offline before litellm is first imported
from litellm.integrations.custom_logger import CustomLogger  # noqa: E402 (after the environment is set)
from litellm.llms.custom_llm import CustomLLM  # noqa: E402
from litellm.types.utils import LlmProvidersSet as _BUILT_IN  # noqa: E402

__all__ = ["AgentKVLogger", "AgentKVProvider", "addressed_to", "call_request", "conversation_named", "register",
           "unregister"]

COUNTERS = ("observed", "ignored", "succeeded", "failed", "usage_recorded", "overflow_errors", "hook_errors")
SESSION_TAG = "agentkv_session"


def addressed_to(backend: Backend) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate on litellm's call details: is this call addressed to ``backend`` (to any replica of a pool)?"""
    bases = tuple(url.rstrip("/") for url in (backend.replicas or (backend.api_base or "",)))

    def match(details: Mapping[str, Any]) -> bool:
        params = details.get("litellm_params") or {}
        model = details.get("model")
        provider = params.get("custom_llm_provider") or details.get("custom_llm_provider")
        if backend.model not in (model, f"{provider}/{model}"):
            return False
        sent_to = str(params.get("api_base") or "")
        return not any(bases) or any(sent_to.startswith(base) for base in bases if base)

    return match


def observed_request(messages: Any, details: Mapping[str, Any]) -> dict[str, Any] | None:
    """The request kwargs :meth:`Session.observe` needs, from litellm's call details (None: not a chat call)."""
    if not isinstance(messages, list):
        return None
    optional = details.get("optional_params") or {}
    request: dict[str, Any] = {"messages": messages}
    request.update({k: optional[k] for k in OBSERVED_KEYS if optional.get(k) is not None})
    return request


def session_tag(details: Mapping[str, Any]) -> Any:
    """The ``metadata.agentkv_session`` a call was tagged with, if any."""
    metadata = (details.get("litellm_params") or {}).get("metadata") or {}
    return metadata.get(SESSION_TAG) if isinstance(metadata, Mapping) else None


class AgentKVLogger(CustomLogger):
    """Feeds ``session``'s ledger and prefix-cache statistics from litellm calls made outside it.

    ``match`` decides which calls are accounted (default: :func:`addressed_to` the fast backend).
    """

    def __init__(self, session: SessionLike, *, match: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        super().__init__()
        self.session = session
        self._match = match or addressed_to(session.fast)
        self._turns: dict[str, int] = {}
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._changed = threading.Condition()

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot: calls observed, ignored, succeeded, failed; usages recorded; overflows; hook errors."""
        with self._changed:
            return dict(self._counts)

    def wait(self, finished: int, timeout_s: float = 10.0) -> bool:
        """Block until ``finished`` accounted calls have succeeded or failed; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._counts["succeeded"] + self._counts["failed"] >= finished,
                                          timeout_s)

    def _add(self, name: str) -> None:
        with self._changed:
            self._counts[name] += 1
            self._changed.notify_all()

    # ------------------------------------------------------------------------- litellm's hooks
    def log_pre_api_call(self, model: Any, messages: Any, kwargs: dict[str, Any]) -> None:
        """Before the call (sync and async calls alike): count it, fire warm-ahead when due."""
        call_id = kwargs.get("litellm_call_id")
        with self._changed:
            if call_id is not None and call_id in self._turns:  # a retry of a call already counted
                return
        request = observed_request(messages, kwargs)
        if request is None or not self._mine(kwargs):
            self._add("ignored")
            return
        try:
            observation = self.session.observe(**request)
        except Exception as exc:  # litellm would swallow it; count it and say why
            self._hook_error("pre_api_call", exc)
            return
        if call_id is not None:  # without an id its outcome cannot be matched; the ledger row stays
            with self._changed:
                self._turns[call_id] = observation.turn
        self._add("observed")

    def log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._succeeded(kwargs, response_obj)

    async def async_log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._succeeded(kwargs, response_obj)

    def log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._failed(kwargs)

    async def async_log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self._failed(kwargs)

    # ------------------------------------------------------------------------- bookkeeping
    def _mine(self, details: Mapping[str, Any]) -> bool:
        tag = session_tag(details)
        return (tag is None or tag == self.session.session_id) and self._match(details)

    def _take_turn(self, details: Mapping[str, Any]) -> int | None:
        with self._changed:
            return self._turns.pop(details.get("litellm_call_id"), None)

    def _succeeded(self, details: Mapping[str, Any], response: Any) -> None:
        turn = self._take_turn(details)
        if turn is None:
            return
        usage = response_usage(response)  # a figure refused is absent, and named in an event
        report_rejected(usage, session=self.session.session_id)
        cached = usage.cached_tokens
        try:
            if cached is not None:
                self.session.record_usage(turn, cached_tokens=cached)
                self._add("usage_recorded")
        except Exception as exc:  # litellm would swallow it; count it and say why
            self._hook_error("success", exc)
        finally:
            self._add("succeeded")

    def _failed(self, details: Mapping[str, Any]) -> None:
        if self._take_turn(details) is None:
            return
        error = details.get("exception")
        if isinstance(error, BaseException) and overflow_from_error(error) is not None:
            self._add("overflow_errors")
        self._add("failed")

    def _hook_error(self, hook: str, exc: Exception) -> None:
        emit("litellm_hook_error", level="warning", hook=hook, error=type(exc).__name__,
             session=self.session.session_id)
        self._add("hook_errors")


# ============================================================================= the provider: calls run through a Session

ID_KEYS = ("session_id", "thread_id", "conversation_id")  # the metadata keys naming a conversation, in this order
NO_LOG = {"no-log": True}  # the Session's own litellm calls: the caller's call is the one litellm's callbacks see
_SET_HERE = ("stream", "stream_options")
_LITELLM_DEFAULT_TIMEOUT_S = 600.0  # what litellm hands a provider when the call gave no timeout


def register(name: str, target: Any) -> "AgentKVProvider":
    """Register ``target`` (a Session, a Conversations, or a callable returning one, called on the first call) as
    litellm's provider ``name``: ``litellm.completion(model=f"{name}/<alias>", ...)`` then runs through it. A name
    registered before is replaced; a name of litellm's own providers is refused (litellm would not consult it)."""
    if not name or "/" in name or name in _BUILT_IN:
        raise ValueError(f"{name!r} cannot name a litellm provider: it must be new and hold no '/'")
    provider = AgentKVProvider(target)
    litellm.custom_provider_map = [*_others(name), {"provider": name, "custom_handler": provider}]
    return provider


def unregister(name: str) -> None:
    """Remove the provider ``name`` from litellm's ``custom_provider_map`` (calls to ``name/...`` then fail)."""
    litellm.custom_provider_map = _others(name)


def _others(name: str) -> list[Any]:
    return [item for item in litellm.custom_provider_map if item.get("provider") != name]


def conversation_named(litellm_params: Mapping[str, Any]) -> str | None:
    """The conversation a call names: its ``metadata``'s ``session_id``/``thread_id``/``conversation_id``, or
    litellm's ``litellm_session_id`` (None: it names none)."""
    metadata = litellm_params.get("metadata")
    named = [metadata.get(key) for key in ID_KEYS] if isinstance(metadata, Mapping) else []
    named.append(litellm_params.get("litellm_session_id"))
    return next((value for value in named if isinstance(value, str) and value), None)


def inner_call(messages: list[Any], details: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs of :meth:`Session.completion` for a call litellm handed a provider (``details``: its keywords)."""
    call = {k: v for k, v in (details.get("optional_params") or {}).items() if k not in _SET_HERE}
    call["messages"] = messages
    if details.get("headers"):
        call["extra_headers"] = dict(details["headers"])
    timeout = details.get("timeout")
    if timeout is not None and timeout not in (_LITELLM_DEFAULT_TIMEOUT_S, litellm.request_timeout):  # none given
        call["timeout"] = timeout
    user = _user(details)
    if user is not None:
        call["user"] = user
    return {**call, **NO_LOG}


def _user(details: Mapping[str, Any]) -> Any:
    """The call's ``user``: litellm keeps it off a custom provider's params, on its logging object."""
    call_details = getattr(details.get("logging_obj"), "model_call_details", None)
    return call_details.get("user") if isinstance(call_details, Mapping) else None


@contextlib.contextmanager
def litellm_errors(model: str, provider: str) -> Iterator[None]:
    """agentkv's errors as litellm's mapped exceptions (litellm's own, from the backends, pass as they are)."""
    try:
        yield
    except ContextOverflowError as exc:
        raise litellm.ContextWindowExceededError(message=str(exc), model=model, llm_provider=provider) from exc
    except InvalidRequestError as exc:
        raise litellm.BadRequestError(message=str(exc), model=model, llm_provider=provider) from exc
    except PoolExhaustedError as exc:
        raise litellm.ServiceUnavailableError(message=str(exc), model=model, llm_provider=provider) from exc
    except AnswerTooLarge as exc:
        raise litellm.APIError(status_code=502, message=str(exc), model=model, llm_provider=provider) from exc


class AgentKVProvider(CustomLLM):
    """litellm's ``CustomLLM`` over a Session, a Conversations, or a callable returning one: see :func:`register`."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        self._target = target
        self._built: Any = None
        self._lock = threading.Lock()

    def session(self, messages: list[Any], details: Mapping[str, Any]) -> SessionLike:
        """The Session of the conversation a call belongs to (a Conversations' ``tenant_of`` is handed
        :func:`call_request`)."""
        params = details.get("litellm_params") or {}
        body = {"messages": messages, "tools": (details.get("optional_params") or {}).get("tools"),
                "user": _user(details)}
        session: SessionLike = session_of(self.target(), conversation=conversation_named(params),
                                          body={k: v for k, v in body.items() if v is not None},
                                          request=call_request(details))
        return session

    def target(self) -> Any:
        """The Session or Conversations calls run through (a factory is called once, on the first call)."""
        if hasattr(self._target, "completion") or hasattr(self._target, "session_for") or not callable(self._target):
            return self._target
        with self._lock:
            if self._built is None:
                self._built = self._target()
            return self._built

    # ------------------------------------------------------------------------- litellm's four entry points
    def completion(self, model: str, messages: list[Any], **details: Any) -> Any:
        with litellm_errors(model, _provider(details)):
            return self.session(messages, details).completion(**inner_call(messages, details))

    async def acompletion(self, model: str, messages: list[Any], **details: Any) -> Any:
        with litellm_errors(model, _provider(details)):
            return await self.session(messages, details).acompletion(**inner_call(messages, details))

    def streaming(self, model: str, messages: list[Any], **details: Any) -> Iterator[Any]:
        """The Session's stream of litellm chunks, the usage chunk last (asked of the backend whatever the caller
        asked); opened here, so that an error before the first chunk is raised by the call itself."""
        with litellm_errors(model, _provider(details)):
            stream = self.session(messages, details).completion(**inner_call(messages, details), **_STREAM)
        return provider_chunks(stream)

    async def astreaming(self, model: str, messages: list[Any], **details: Any) -> AsyncIterator[Any]:
        """The async stream (litellm wraps an async generator, so an error before the first chunk is raised by it)."""
        with litellm_errors(model, _provider(details)):
            stream = await self.session(messages, details).acompletion(**inner_call(messages, details), **_STREAM)
        finish: str | None = None
        async for chunk in stream:
            finish = first_finish_reason(chunk) or finish
            yield usage_chunk(chunk, finish)


_STREAM: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}


def provider_chunks(stream: Any) -> Iterator[Any]:
    """A Session's stream as a provider's chunks (:func:`usage_chunk`)."""
    finish: str | None = None
    for chunk in stream:
        finish = first_finish_reason(chunk) or finish
        yield usage_chunk(chunk, finish)


def usage_chunk(chunk: Any, finish_reason: str | None) -> Any:
    """``chunk`` as litellm's stream wrapper takes it from a provider: a usage-only chunk (no choices) becomes a
    ``GenericStreamingChunk`` (the wrapper drops a ``ModelResponseStream`` with no content after the finish, and
    would then count the prompt itself); every other chunk passes as it is."""
    usage = getattr(chunk, "usage", None)
    if usage is None or getattr(chunk, "choices", None):
        return chunk
    return {"text": "", "tool_use": None, "is_finished": True, "finish_reason": finish_reason or "stop", "index": 0,
            "usage": usage.model_dump(exclude_none=True) if hasattr(usage, "model_dump") else dict(usage)}


def _provider(details: Mapping[str, Any]) -> str:
    return str((details.get("litellm_params") or {}).get("custom_llm_provider") or "agentkv")


def call_request(details: Mapping[str, Any]) -> dict[str, Any]:
    """What a Conversations' ``tenant_of`` is handed for a litellm call: its ``api_key``, ``metadata``, ``user`` and
    ``headers`` (as the gateway takes the tenant from the API key)."""
    return {"api_key": details.get("api_key"), "metadata": (details.get("litellm_params") or {}).get("metadata"),
            "user": _user(details), "headers": details.get("headers") or {}}
