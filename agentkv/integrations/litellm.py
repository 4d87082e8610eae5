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
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import agentkv._env as _env
from agentkv.backends import Backend
from agentkv.events import emit
from agentkv.protocols import SessionLike
from agentkv.overflow import overflow_from_error
from agentkv.wire.openai import OBSERVED_KEYS
from agentkv.wire.usage import response_cached_tokens

_env.import_litellm()  # cost map local and tiktoken offline before litellm is first imported
from litellm.integrations.custom_logger import CustomLogger  # noqa: E402 (after the environment is set)

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
        cached = response_cached_tokens(response)
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
