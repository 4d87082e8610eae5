"""The Session: routes each request of an agent's loop between a fast and a slow backend.

:class:`Session` is its state (:class:`~agentkv._session.state.SessionState`, one object) with the public methods on
top, each a few lines over functions of that state. One request, in the order it happens:

- :meth:`Session.completion` (or :meth:`~Session.acompletion`; :meth:`~Session.prepare` for senders outside litellm)
  opens, counts and plans it (:mod:`agentkv._session.steps`: the pure core decides) and fires the warm-ahead;
- :meth:`Session.turn` runs the turn in the one loop (:mod:`agentkv._session.drive`) that does what
  :func:`~agentkv._session.decide.next_action` says: send, hand off, recover (:mod:`agentkv._session.reactive`),
  fail over, finish or give up;
- :func:`~agentkv._session.steps.finish` records the answer.

    with Session(fast=fast, slow=slow, tenant="acme", session_id="chat-42") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)
        s.last_route, s.stats()
"""

from __future__ import annotations

from pathlib import Path

from typing import Any, Awaitable, Callable, Mapping, TypeVar

from agentkv._session import outside, steps
from agentkv._session.attempts import Attempt
from agentkv._session.decide import Failed, FailOver, Recover
from agentkv._session.drive import TurnEnd, arun, run
from agentkv._session.inputs import check_headers, request_payload
from agentkv._session.reactive import fail_over, recover
from agentkv._session.state import DEFAULT_REQUEST_TIMEOUT_S, SessionState
from agentkv._session.warm_prefix import prefix_report
from agentkv.prefix import PrefixReport
from agentkv.protocols import Observation
from agentkv.retry import CLIENT_RETRIES_OFF
from agentkv.routing import RouteDecision
from agentkv.stats import LedgerEntry
from agentkv.tokens import TokenCount

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "Session"]

T = TypeVar("T")


class Session(SessionState):
    """A fast/slow routing session for one conversation of one tenant.

    ``fast`` answers while the conversation fits its window; ``slow`` takes what it cannot hold.
    ``client`` is anything with litellm's ``completion``/``acompletion`` (litellm itself by default,
    imported on first use and never on an event loop), called with its own retries off (``num_retries=0``,
    ``max_retries=0``): ``retry`` (a :class:`~agentkv.RetryPolicy`) is the one bound, at most ``attempts`` tries
    per backend in a turn, whatever recovers or fails over in between;
    ``discovery``, ``cooldowns`` and ``in_flight`` default to process-wide shared instances; ``state``
    (a :class:`~agentkv.state.StateStore`, e.g. ``RedisStore.from_url(url)``; ``AGENTKV_REDIS_URL``
    when not given) shares the warm-ahead guards and discovered windows across replicas; ``http``
    is the HTTP seam the Session's own counters use (``/tokenize``). Counts are estimated locally and
    the exact source (``/tokenize``) asked only where a decision depends on the difference
    (:meth:`~agentkv.tokens.TokenCounter.count_for`); ``count_exactly=True`` asks it every time.
    ``cache_salt`` is sent as ``extra_body.cache_salt`` to self-hosted backends; when it is not given
    and the Session has a tenant, it is derived as HMAC(``cache_salt_secret``, tenant) (the secret
    defaulting to ``AGENTKV_CACHE_SALT_SECRET``). A tenant on a self-hosted backend with neither is
    refused (:class:`ConfigurationError`) unless ``cache_salt=False`` opts out of isolation knowingly.
    ``request_timeout_s`` bounds each attempt of a request (a call's own ``timeout=`` wins; None: the
    client's default, litellm's being 6,000 s). ``clock`` (``time.monotonic`` by default) times the turns the
    warm-ahead break-even gate sees (``WarmAheadPolicy(break_even=True)``).
    ``ledger`` (a started :class:`~agentkv.cache_ledger.CacheLedger`): when it follows the slow backend, warm-ahead
    is event-aware (skips a resident prefix, re-warms an evicted one, tops up a growing tail; see
    ``docs/warm-ahead.md``), and every request to a backend it follows records the ledger's prediction
    against the ``cached_tokens`` reported (``ledger_predictions*`` in :meth:`stats`).
    ``ledger_rows`` keeps only that many of the latest rows of :attr:`ledger` (their turns go on counting): for a
    Session that lives long, as a gateway's conversation can; None (the default) keeps every row.
    """

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def close(self) -> None:
        """Stop accepting requests. In-flight warms are left to finish or time out; nothing waits. The Gemini
        explicit caches its requests created or read are released in the background, each deleted once no other
        Session holds it (``drain_warms`` waits for that)."""
        self.closed = True
        if self.explicit_caches:
            self._jobs.thread(self.explicit_caches.delete)

    async def aclose(self) -> None:
        """Async close. In-flight warm tasks run on, bounded by their timeout: a warm fired on the last
        turn of a call is exactly the one the next call wants."""
        self.closed = True
        if self.explicit_caches:
            self._jobs.task(self.explicit_caches.adelete(), 30.0)

    # ----------------------------------------------------------------- a turn through litellm

    def completion(self, **kwargs: Any) -> Any:
        """Route and send a chat completion; litellm kwargs pass through; returns litellm's response."""
        kwargs = dict(self._sends(self.fast.model, kwargs))
        payload = steps.open_request(self, kwargs)
        known = steps.facts(self)
        attempt = steps.plan(self, kwargs, payload, steps.count(self, kwargs, payload, known), known)
        steps.maybe_warm(self, attempt, known)
        ended = self.turn(attempt, lambda a: self.client.completion(**_client_call(a)), streamed=bool(kwargs.get("stream")))
        return steps.finish(self, ended.attempt, ended.result(), asynchronous=False)

    async def acompletion(self, **kwargs: Any) -> Any:
        """The async twin of :meth:`completion`: every input is awaited, nothing blocks the event loop."""
        kwargs = dict(self._sends(self.fast.model, kwargs))
        payload = steps.open_request(self, kwargs)
        known = await steps.afacts(self)
        attempt = steps.plan(self, kwargs, payload, await steps.acount(self, kwargs, payload, known), known)
        await steps.amaybe_warm(self, attempt, known)
        ended = await self.aturn(attempt, lambda a: self.client.acompletion(**_client_call(a)),
                                 streamed=bool(kwargs.get("stream")))
        return steps.finish(self, ended.attempt, ended.result(), asynchronous=True)

    # ----------------------------------------------------------------- a turn its caller sends

    def prepare(self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> Attempt:
        """Count, route and clamp a raw OpenAI request ``body`` its caller sends itself, and warm when due.

        For senders outside litellm (the httpx transport, the LangChain router, the gateway): the returned
        :class:`Attempt` says where it goes (``decision``, ``backend``) and with which output budget;
        a warm repeats ``body`` itself with a one-token budget. Hand an overflow to :meth:`recover` and
        the answer to :meth:`answered`.

        ``body`` is a ``/chat/completions`` body (``messages``) or a ``/completions`` one: a ``prompt``
        alone (a string or a list of strings) is a text completion, counted as that text and routed by
        the same rules; its warm is a one-token ``/completions`` POST of the same prompt to a self-hosted
        slow backend (:attr:`Attempt.text` says which endpoint the attempt is for).

        ``headers``: the request's own HTTP headers; those the slow backend names (its ``affinity_headers`` and
        ``forward_headers``: :func:`agentkv.fleet.routing_headers`) ride on its warm, so a router sends the warm where
        it sends the request; a header no client can send is a :class:`ConfigurationError` here. Send each try with
        :func:`agentkv.wire.openai.routing_headers_of` besides the request's own: the conversation's routing key goes
        there.
        """
        check_headers(headers, "headers")  # before anything is counted or sent
        payload = steps.open_request(self, dict(body), text=True)
        known = steps.facts(self)
        attempt = steps.plan(self, dict(body), payload, steps.count(self, body, payload, known), known,
                             headers=headers)
        attempt.raw = True
        steps.maybe_warm(self, attempt, known)
        return attempt

    async def aprepare(self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> Attempt:
        """The async twin of :meth:`prepare` (the count is awaited; a warm runs as a task)."""
        check_headers(headers, "headers")
        payload = steps.open_request(self, dict(body), text=True)
        known = await steps.afacts(self)
        attempt = steps.plan(self, dict(body), payload, await steps.acount(self, body, payload, known), known,
                             headers=headers)
        attempt.raw = True
        await steps.amaybe_warm(self, attempt, known)
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
        return outside.presend(self, body)

    def turn(self, attempt: Attempt, send: Callable[[Attempt], T], *, streamed: bool = False,
             retries: bool = True) -> TurnEnd[T]:
        """Carry a prepared ``attempt`` (:meth:`prepare`) to the end of its turn, ``send(attempt)`` making each try.

        For senders outside litellm (the OpenAI transport, the gateway): the Session decides every next step
        (:func:`~agentkv._session.decide.next_action`) and this carries it out, as :meth:`completion` does: tries under
        the :class:`RetryPolicy`, the KV handoff at the escalation, an overflow clamped or escalated and an outage
        failed over on fresh window facts. ``send`` raises what went wrong (an error answer as an exception with
        ``status_code``); ``streamed``: the caller asked for a stream; ``retries=False``: ``send`` retries on its own
        (a LangChain chat model, a gateway's clients), so each try is sent once. Hand the :class:`TurnEnd`'s answer to
        :meth:`answered`; its ``error``, when set, is the turn's answer."""
        return run(self, attempt, send, streamed=streamed, retries=retries)

    async def aturn(self, attempt: Attempt, send: Callable[[Attempt], Awaitable[T]], *,
                    streamed: bool = False, retries: bool = True) -> TurnEnd[T]:
        """The async twin of :meth:`turn`."""
        return await arun(self, attempt, send, streamed=streamed, retries=retries)

    def recover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The next try after ``attempt`` failed with ``error`` (one step of :meth:`turn`): a recoverable overflow is
        clamped or escalated, an outage fails over when the other backend can take it; anything else is re-raised."""
        action = steps.next_step(self, attempt, Failed(error))
        if isinstance(action, Recover):
            return recover(self, attempt, error, action.overflow, steps.recount(self, attempt), steps.facts(self))
        if isinstance(action, FailOver):
            steps.eject(self, attempt, error)  # a pool's replica found down: never this turn's again
            return fail_over(self, attempt, error, steps.facts(self))
        raise error

    async def arecover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The async twin of :meth:`recover`."""
        action = steps.next_step(self, attempt, Failed(error))
        if isinstance(action, Recover):
            return recover(self, attempt, error, action.overflow, await steps.arecount(self, attempt),
                           await steps.afacts(self))
        if isinstance(action, FailOver):
            await steps.aeject(self, attempt, error)
            return fail_over(self, attempt, error, await steps.afacts(self))
        raise error

    def answered(self, attempt: Attempt, response: Any, *, asynchronous: bool = False) -> Any:
        """Record ``attempt`` as answered with ``response`` (a dict or object with OpenAI's ``usage``):
        requests per backend, the ledger row, the escalation and its cached tokens, as :meth:`completion`."""
        return steps.finish(self, attempt, response, asynchronous=asynchronous)

    # ----------------------------------------------------------------- a request sent elsewhere, or none

    def observe(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """Account a request sent outside the Session (a LangChain callback, a litellm logger).

        The request is counted and recorded in the ledger (as sent to ``sent_to``, "fast" or "slow"),
        and warm-ahead fires when due; nothing else is sent. The returned :class:`Observation` says
        whether fast can take the request as it is.
        """
        role = outside.sent_to_role(self, sent_to)
        payload = steps.open_request(self, kwargs)
        known = steps.facts(self)
        attempt, decision = outside.observed(self, kwargs, payload, steps.count(self, kwargs, payload, known), known,
                                             role)
        steps.maybe_warm(self, attempt, known)
        return outside.observation(self, attempt, decision, known)

    async def aobserve(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """The async twin of :meth:`observe` (warms run as tasks)."""
        role = outside.sent_to_role(self, sent_to)
        payload = steps.open_request(self, kwargs)
        known = await steps.afacts(self)
        attempt, decision = outside.observed(self, kwargs, payload, await steps.acount(self, kwargs, payload, known),
                                             known, role)
        await steps.amaybe_warm(self, attempt, known)
        return outside.observation(self, attempt, decision, known)

    def route(self, **kwargs: Any) -> RouteDecision:
        """The route this Session would choose for a request, sending and recording nothing.

        Raises :class:`ContextOverflowError` when no backend can hold it.
        """
        payload, known = request_payload(kwargs, self._backends(), self.counters.values()), steps.facts(self)
        return steps.decide(self, kwargs, steps.count(self, kwargs, payload, known), known)

    async def aroute(self, **kwargs: Any) -> RouteDecision:
        """The async twin of :meth:`route`."""
        payload, known = request_payload(kwargs, self._backends(), self.counters.values()), await steps.afacts(self)
        return steps.decide(self, kwargs, await steps.acount(self, kwargs, payload, known), known)

    def count(self, **kwargs: Any) -> TokenCount:
        """Count a request as the fast backend will receive it, without sending anything."""
        return self._counter(self.fast).count(request_payload(kwargs, self._backends(), self.counters.values()))

    def record_usage(self, turn: int, *, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to an observed ledger turn."""
        self._record.record_usage(turn, cached_tokens)

    def run(self, user_message: Any, tools: Any = None, *, max_steps: int = 20, **kwargs: Any) -> Any:
        """Run a ReAct loop through this Session's routing (see :func:`agentkv.react.run_loop`)."""
        from agentkv.react import run_loop

        return run_loop(self, user_message, tools, max_steps=max_steps, **kwargs)

    async def arun(self, user_message: Any, tools: Any = None, *, max_steps: int = 20, **kwargs: Any) -> Any:
        """The async twin of :meth:`run` (see :func:`agentkv.react.arun_loop`)."""
        from agentkv.react import arun_loop

        return await arun_loop(self, user_message, tools, max_steps=max_steps, **kwargs)

    @property
    def ledger(self) -> list[LedgerEntry]:
        """One row per request (the latest ``ledger_rows`` of them when bounded): tokens, the tool schemas' share,
        count source, route, warm-ahead, cached tokens."""
        return self._record.ledger

    def write_ledger(self, path: str | Path) -> Path:
        """Write :attr:`ledger` (and fast's window, the output floor and the warm-ahead threshold) to ``path`` as JSON
        lines, for ``agentkv report`` (:mod:`agentkv.report`): sizes, routes and cache figures, no prompt text."""
        from agentkv.report import write_ledger

        threshold = self.warm_ahead.threshold if self.slow is not None else None
        return write_ledger(path, self.ledger, fast_window=steps.facts(self).fast.window,
                            output_floor=self.routing.output_floor, warm_threshold=threshold)

    def stats(self) -> dict[str, Any]:
        """Plain dict of counters: requests per backend, routes, clamps, fallbacks, warms, cached tokens."""
        return self._stats.snapshot()

    def prefix_report(self) -> PrefixReport | None:
        """Compare the rendered token prefixes of the last two requests (None before the second)."""
        if len(self._history) < 2:
            return None
        previous, current = self._history[-2:]
        counter = self._counter(self.fast)
        return prefix_report(previous, current, counter.token_ids(previous, add_generation_prompt=False),
                             counter.token_ids(current))

    async def aprefix_report(self) -> PrefixReport | None:
        """The async twin of :meth:`prefix_report`."""
        if len(self._history) < 2:
            return None
        previous, current = self._history[-2:]
        counter = self._counter(self.fast)
        return prefix_report(previous, current, await counter.atoken_ids(previous, add_generation_prompt=False),
                             await counter.atoken_ids(current))

    def drain_warms(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` for this Session's background work on threads (warms, diagnostics);
        True when none is left. For tests, benchmarks and demos: requests never wait for it."""
        return self._jobs.drain(timeout_s)

    async def adrain_warms(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for this Session's background tasks (tests, benchmarks, demos)."""
        await self._jobs.adrain(timeout_s)


def _client_call(attempt: Attempt) -> dict[str, Any]:
    """This try's litellm kwargs with the client's own retries off: the Session's :class:`RetryPolicy` is the one
    bound."""
    return {**attempt.call_kwargs, **CLIENT_RETRIES_OFF}
