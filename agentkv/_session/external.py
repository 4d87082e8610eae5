"""The Session's surface for callers that send requests themselves (a LangChain callback, a litellm logger,
the httpx transport, the LangChain router): count and route without sending (:meth:`~SendsOutside.route`,
:meth:`~SendsOutside.count`), account a request sent elsewhere (:meth:`~SendsOutside.observe`), or plan one,
recover it and record its answer (:meth:`~SendsOutside.prepare`, :meth:`~SendsOutside.recover`,
:meth:`~SendsOutside.answered`). Each gathers its inputs like the Session's drivers and asks the same pure core.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, Mapping

from agentkv._session.attempts import Attempt
from agentkv._session.decide import Failed, FailOver, Recover
from agentkv._session.reactive import ReactivePath
from agentkv._session.inputs import Facts, max_tokens_of, request_payload, to_facts
from agentkv.errors import ContextOverflowError
from agentkv.protocols import Observation
from agentkv.routing import RouteDecision, as_sent
from agentkv.tokens import Payload, TokenCount
from agentkv.tokens.ceiling import byte_ceiling

__all__ = ["SendsOutside"]


class SendsOutside(ReactivePath):
    """A layer of :class:`~agentkv.Session`: the entry points for requests the Session does not send itself."""

    def observe(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """Account a request sent outside the Session (a LangChain callback, a litellm logger).

        The request is counted and recorded in the ledger (as sent to ``sent_to``, "fast" or "slow"),
        and warm-ahead fires when due; nothing else is sent. The returned :class:`Observation` says
        whether fast can take the request as it is.
        """
        role = self._sent_to(sent_to)
        payload = self._open_request(kwargs)
        facts = self._facts()
        attempt, decision = self._observed(kwargs, payload, self._count(kwargs, payload, facts), facts, role)
        self._maybe_warm(attempt, facts, asynchronous=False)
        return self._observation(attempt, decision, facts)

    async def aobserve(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """The async twin of :meth:`observe` (warms run as tasks)."""
        role = self._sent_to(sent_to)
        payload = self._open_request(kwargs)
        facts = await self._afacts()
        attempt, decision = self._observed(kwargs, payload, await self._acount(kwargs, payload, facts), facts, role)
        await self._amaybe_warm(attempt, facts)
        return self._observation(attempt, decision, facts)

    def prepare(self, body: Mapping[str, Any]) -> Attempt:
        """Count, route and clamp a raw OpenAI request ``body`` its caller sends itself, and warm when due.

        For senders outside litellm (the httpx transport, the LangChain router, the gateway): the returned
        :class:`Attempt` says where it goes (``decision``, ``backend``) and with which output budget;
        a warm repeats ``body`` itself with a one-token budget. Hand an overflow to :meth:`recover` and
        the answer to :meth:`answered`.

        ``body`` is a ``/chat/completions`` body (``messages``) or a ``/completions`` one: a ``prompt``
        alone (a string or a list of strings) is a text completion, counted as that text and routed by
        the same rules; its warm is a one-token ``/completions`` POST of the same prompt to a self-hosted
        slow backend (:attr:`Attempt.text` says which endpoint the attempt is for).
        """
        payload = self._open_request(dict(body), text=True)
        facts = self._facts()
        attempt = self._prepared(body, payload, self._count(body, payload, facts), facts)
        self._maybe_warm(attempt, facts, asynchronous=False)
        return attempt

    async def aprepare(self, body: Mapping[str, Any]) -> Attempt:
        """The async twin of :meth:`prepare` (the count is awaited; a warm runs as a task)."""
        payload = self._open_request(dict(body), text=True)
        facts = await self._afacts()
        attempt = self._prepared(body, payload, await self._acount(body, payload, facts), facts)
        await self._amaybe_warm(attempt, facts)
        return attempt

    def presend(self, body: Mapping[str, Any]) -> Attempt | None:
        """The try a request is certain to get, decided before it is counted, or None when that is not certain.

        Certain means: fast, as it is (no clamp), and far from every boundary (the route, the clamp, warm-ahead,
        by :func:`~agentkv.routing.interval_decides`) for any count up to the payload's byte ceiling
        (:mod:`agentkv.tokens.ceiling`, trusted once fast's exact counts have held within theirs), on windows
        discovered within the last second. A caller may then send the request at once and call
        :meth:`aprepare` while the backend works: it counts, logs, records and warms as always, and its attempt
        is what the request should have been (the caller compares the two, and re-sends when they differ).
        Nothing is recorded here, and nothing is ever raised: a request this cannot vouch for gets None."""
        if self.closed or self.slow is None or "cache_salt" in body or "extra_body" in body:
            return None
        fast_info = self.discovery.recent(self.fast, model_known=False)
        slow_info = self.discovery.recent(self.slow)
        if fast_info is None or slow_info is None or not self._counter(self.fast).bound.trusts_ceiling:
            return None
        kwargs = dict(body)
        try:
            max_tokens = max_tokens_of(kwargs)
            payload = request_payload(kwargs, self._backends(), self.counters.values())
        except (ValueError, TypeError):  # InvalidRequestError is a ValueError: aprepare reports it
            return None
        ceiling = byte_ceiling(payload)
        facts = to_facts(self.fast, self.slow, fast_info, slow_info)
        if ceiling is None or not self._decides(kwargs, facts)(0, ceiling):
            return None
        count = TokenCount(ceiling, ceiling, 0, "ceiling", False, 0, ceiling)
        try:
            decision = self._decide(kwargs, count, facts)
        except ContextOverflowError:
            return None
        if decision.role != "fast" or decision.reason != "fits" or decision.max_tokens != max_tokens:
            return None
        return Attempt(decision, self.fast, kwargs, payload, count, self.cache_salt, raw=True,
                       keeps_caller_salt=self._keeps_caller_salt)

    def recover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The next try after ``attempt`` failed with ``error``: a recoverable overflow is clamped or escalated,
        an outage fails over when the other backend can take it; anything else is re-raised. (The Session's
        own drivers, the OpenAI transport and the gateway take this step inside :func:`~agentkv._session.drive.run`.)"""
        action = self._next_action(attempt, Failed(error))
        if isinstance(action, Recover):
            return self._recover(attempt, error, action.overflow, self._recount(attempt), self._facts())
        if isinstance(action, FailOver):
            return self._fail_over(attempt, error, self._facts())
        raise error

    async def arecover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The async twin of :meth:`recover`."""
        action = self._next_action(attempt, Failed(error))
        if isinstance(action, Recover):
            return self._recover(attempt, error, action.overflow, await self._arecount(attempt), await self._afacts())
        if isinstance(action, FailOver):
            return self._fail_over(attempt, error, await self._afacts())
        raise error

    def answered(self, attempt: Attempt, response: Any, *, asynchronous: bool = False) -> Any:
        """Record ``attempt`` as answered with ``response`` (a dict or object with OpenAI's ``usage``):
        requests per backend, the ledger row, the escalation and its cached tokens, as :meth:`completion`."""
        return self._finish(attempt, response, asynchronous=asynchronous)

    def _prepared(self, body: Mapping[str, Any], payload: Payload, count: TokenCount, facts: Facts) -> Attempt:
        return replace(self._plan(dict(body), payload, count, facts), raw=True)

    def route(self, **kwargs: Any) -> RouteDecision:
        """The route this Session would choose for a request, sending and recording nothing.

        Raises :class:`ContextOverflowError` when no backend can hold it.
        """
        payload, facts = request_payload(kwargs, self._backends(), self.counters.values()), self._facts()
        return self._decide(kwargs, self._count(kwargs, payload, facts), facts)

    async def aroute(self, **kwargs: Any) -> RouteDecision:
        """The async twin of :meth:`route`."""
        payload, facts = request_payload(kwargs, self._backends(), self.counters.values()), await self._afacts()
        return self._decide(kwargs, await self._acount(kwargs, payload, facts), facts)

    def count(self, **kwargs: Any) -> TokenCount:
        """Count a request as the fast backend will receive it, without sending anything."""
        return self._counter(self.fast).count(request_payload(kwargs, self._backends(), self.counters.values()))

    def record_usage(self, turn: int, *, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to an observed ledger turn."""
        self._record.record_usage(turn, cached_tokens)

    def _sent_to(self, sent_to: str) -> Literal["fast", "slow"]:
        if sent_to == "fast" or (sent_to == "slow" and self.slow is not None):
            return "slow" if sent_to == "slow" else "fast"
        raise ValueError(f"sent_to must be 'fast' or 'slow' (with a slow backend), got {sent_to!r}")

    def _observed(self, kwargs: dict[str, Any], payload: Payload, count: TokenCount, facts: Facts,
                  role: Literal["fast", "slow"]) -> tuple[Attempt, RouteDecision | None]:
        try:
            decision: RouteDecision | None = self._decide(kwargs, count, facts)
        except ContextOverflowError:
            decision = None
        target = facts.fast if role == "fast" else facts.slow
        sent = as_sent(target, role, input_tokens=count.total, max_tokens=max_tokens_of(kwargs), count_source=count.source)
        return Attempt(sent, self._backend(role), kwargs, payload, count, self.cache_salt,
                       keeps_caller_salt=self._keeps_caller_salt), decision

    def _observation(self, attempt: Attempt, decision: RouteDecision | None, facts: Facts) -> Observation:
        target = facts.fast if attempt.decision.role == "fast" else facts.slow
        entry = self._record.observed(attempt.count, target.name, attempt.warm)
        return Observation(entry.turn, attempt.count, decision, facts.fast.window, attempt.warm, facts.slow.window)
