"""The Session: routes each request of an agent's loop between a fast and a slow backend.

``Session.completion`` and ``Session.acompletion`` are twin drivers, each read like tenacity's
``Retrying.__call__``: gather the inputs that need I/O (windows and served models through
:class:`~agentkv.discovery.WindowDiscovery`, the count through :class:`~agentkv.tokens.TokenCounter`;
the async driver awaits every one), ask the pure core for a decision (:mod:`agentkv.routing`,
:mod:`agentkv.warm.policy`), send, and on a context overflow ask the core for the next try.

    with Session(fast=fast, slow=slow, tenant="acme", session_id="chat-42") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)
        s.last_route, s.stats()
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from agentkv._session.attempts import Attempt
from agentkv._session.core import DEFAULT_REQUEST_TIMEOUT_S
from agentkv._session.drive import TurnEnd, arun, run
from agentkv._session.external import SendsOutside
from agentkv._session.warm_prefix import prefix_report
from agentkv.prefix import PrefixReport
from agentkv.retry import CLIENT_RETRIES_OFF
from agentkv.stats import LedgerEntry

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "Session"]

T = TypeVar("T")


class Session(SendsOutside):
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
        """Stop accepting requests. In-flight warms are left to finish or time out; nothing waits."""
        self.closed = True

    async def aclose(self) -> None:
        """Async close. In-flight warm tasks run on, bounded by their timeout: a warm fired on the last
        turn of a call is exactly the one the next call wants."""
        self.close()

    # ----------------------------------------------------------------- the drivers

    def completion(self, **kwargs: Any) -> Any:
        """Route and send a chat completion; litellm kwargs pass through; returns litellm's response."""
        kwargs = dict(self._sends(self.fast.model, kwargs))
        payload = self._open_request(kwargs)
        facts = self._facts()
        attempt = self._plan(kwargs, payload, self._count(kwargs, payload, facts), facts)
        self._maybe_warm(attempt, facts, asynchronous=False)
        ended = run(self, attempt, lambda a: self.client.completion(**self._client_call(a)),
                    streamed=bool(kwargs.get("stream")))
        return self._finish(ended.attempt, ended.result(), asynchronous=False)

    async def acompletion(self, **kwargs: Any) -> Any:
        """The async twin of :meth:`completion`: every input is awaited, nothing blocks the event loop."""
        kwargs = dict(self._sends(self.fast.model, kwargs))
        payload = self._open_request(kwargs)
        facts = await self._afacts()
        attempt = self._plan(kwargs, payload, await self._acount(kwargs, payload, facts), facts)
        await self._amaybe_warm(attempt, facts)
        ended = await arun(self, attempt, lambda a: self.client.acompletion(**self._client_call(a)),
                           streamed=bool(kwargs.get("stream")))
        return self._finish(ended.attempt, ended.result(), asynchronous=True)

    def turn(self, attempt: Attempt, send: Callable[[Attempt], T], *, streamed: bool = False) -> TurnEnd[T]:
        """Carry a prepared ``attempt`` (:meth:`prepare`) to the end of its turn, ``send(attempt)`` making each try.

        For senders outside litellm (the OpenAI transport, the gateway): the Session decides every next step
        (:func:`~agentkv._session.decide.next_action`) and this carries it out, as :meth:`completion` does: tries under
        the :class:`RetryPolicy`, the KV handoff at the escalation, an overflow clamped or escalated and an outage
        failed over on fresh window facts. ``send`` raises what went wrong (an error answer as an exception with
        ``status_code``); ``streamed``: the caller asked for a stream. Hand the :class:`TurnEnd`'s answer to
        :meth:`answered`; its ``error``, when set, is the turn's answer."""
        return run(self, attempt, send, streamed=streamed)

    async def aturn(self, attempt: Attempt, send: Callable[[Attempt], Awaitable[T]], *,
                    streamed: bool = False) -> TurnEnd[T]:
        """The async twin of :meth:`turn`."""
        return await arun(self, attempt, send, streamed=streamed)

    @staticmethod
    def _client_call(attempt: Attempt) -> dict[str, Any]:
        """This try's kwargs with the client's own retries off: the Session's :class:`RetryPolicy` is the one bound."""
        return {**attempt.call_kwargs, **CLIENT_RETRIES_OFF}

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
