"""The Session: routes each request of an agent's loop between a fast and a slow backend.

:class:`Session` holds its parts (:class:`~agentkv._session.parts.SessionParts`) behind its public methods. Each
method is one line over a machine (:mod:`agentkv._support.effects`), run by the sync driver (``run``) or the async one
(``arun``): the two twins of a method differ only in which driver runs the same machine. One request, in the order it
happens:

- :meth:`Session.completion` (or :meth:`~Session.acompletion`; :meth:`~Session.prepare` for senders outside litellm)
  opens it, gathers its facts and count, plans it (the pure core decides) and considers the warm-ahead
  (:func:`~agentkv._session.turn.opening`);
- :meth:`Session.turn` carries it through :func:`~agentkv._session.turn.turn`, which does what
  :func:`~agentkv._session.decide.next_action` says: send (with retries), hand off, recover, fail over, finish or give
  up;
- :func:`~agentkv._session.steps.finish` records the answer (:meth:`Session.answered` for callers that send).

    with Session(fast=fast, slow=slow, tenant="acme", session_id="chat-42") as s:
        resp = s.completion(messages=messages, tools=tools, max_tokens=4096)
        s.last_route, s.stats()
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, TypeVar

from agentkv._session import gather, outside, steps, warming
from agentkv._session.attempts import Attempt
from agentkv._session.decide import Failed, FailOver, GiveUp, Recover
from agentkv._session.inputs import check_headers, request_payload
from agentkv._session.processors import registered
from agentkv._session.parts import DEFAULT_REQUEST_TIMEOUT_S, SessionOptions, SessionParts, session_signature
from agentkv._session.turn import TurnEnd, next_try, opening, turn
from agentkv._session.warm_prefix import prefix_report
from agentkv._support.effects import Machine, arun, run
from agentkv.backends import Backend
from agentkv.prefix import PrefixReport
from agentkv.protocols import Observation
from agentkv.retry import CLIENT_RETRIES_OFF, RetryPolicy
from agentkv.routing import RouteDecision, RoutePolicy
from agentkv.stats import LedgerEntry
from agentkv.tokens import TokenCount
from agentkv.warm import WarmAheadPolicy
from agentkv.wire.openai import counted_view

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "Session"]

T = TypeVar("T")


class Session:
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

    def __init__(self, fast: Backend, slow: Backend | None = None, **options: Unpack[SessionOptions]) -> None:
        self._parts = SessionParts(fast, slow, options, registered)

    def __repr__(self) -> str:
        return f"Session(session_id={self.session_id!r}, fast={self.fast.label!r}, " \
               f"slow={None if self.slow is None else self.slow.label!r})"

    # ----------------------------------------------------------------- what it is

    @property
    def fast(self) -> Backend:
        """The backend that answers while the conversation fits its window."""
        return self._parts.fast

    @property
    def slow(self) -> Backend | None:
        """The backend that takes what fast cannot hold (None: fast alone)."""
        return self._parts.slow

    @property
    def tenant(self) -> str | None:
        """Whose conversation this is (its prefix cache is salted apart from every other tenant's)."""
        return self._parts.tenant

    @property
    def session_id(self) -> str:
        """The conversation's id (given, or a fresh UUID)."""
        return self._parts.session_id

    @property
    def routing(self) -> RoutePolicy:
        return self._parts.routing

    @property
    def warm_ahead(self) -> WarmAheadPolicy:
        return self._parts.warm_ahead

    @property
    def retry(self) -> RetryPolicy:
        return self._parts.retry

    @property
    def last_route(self) -> RouteDecision | None:
        """The route of the last request this Session counted (None before the first)."""
        return self._parts.last_route

    @property
    def routing_key(self) -> str:
        """The conversation's opaque routing key (a keyed digest of tenant and session id, never either): what
        agentkv sends a router in ``X-Session-ID`` and uses to choose a pool's replica."""
        return self._parts.routing_key

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed Session refuses requests)."""
        return self._parts.closed

    @property
    def holds_outside(self) -> bool:
        """Whether this Session holds something outside the process that :meth:`close` releases (a Gemini explicit
        cache its requests created or read)."""
        return self._parts.providers.pending()

    def request_extras(self, role: str = "fast") -> dict[str, Any]:
        """What a request to the ``role`` backend ("fast" or "slow") must carry besides its own fields when its
        caller sends it outside agentkv: ``extra_body`` (the tenant's ``cache_salt`` on a self-hosted backend) and
        ``extra_headers`` (the conversation's routing key, for a router), as litellm and the OpenAI SDK take them.

            ChatOpenAI(..., **session.request_extras("fast"))
        """
        backend = self._parts.backend(outside.sent_to_role(self._parts, role))
        return outside.request_extras(self._parts, backend)

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
        run(self._parts.closing(), self._parts.jobs)

    async def aclose(self) -> None:
        """Async close. In-flight warm tasks run on, bounded by their timeout: a warm fired on the last
        turn of a call is exactly the one the next call wants."""
        await arun(self._parts.closing(), self._parts.jobs)

    # ----------------------------------------------------------------- a turn through litellm

    def completion(self, **kwargs: Any) -> Any:
        """Route and send a chat completion; litellm kwargs pass through; returns litellm's response."""
        p = self._parts
        return run(_completion(p, kwargs, lambda a: p.client.completion(**_client_call(a))), p.jobs)

    async def acompletion(self, **kwargs: Any) -> Any:
        """The async twin of :meth:`completion`: every input is awaited, nothing blocks the event loop."""
        p = self._parts
        return await arun(_completion(p, kwargs, lambda a: p.client.acompletion(**_client_call(a))), p.jobs)

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
        it sends the request; a header no client can send is a :class:`ConfigurationError` here. Its streaming switches
        (``stream``, ``stream_options``) are neither counted nor warmed, and ride on each try. Send each try to
        :attr:`Attempt.url` with :attr:`Attempt.content` (its :attr:`Attempt.body` as bytes), and
        :attr:`Attempt.send_headers` besides the request's own: the conversation's routing key goes there.
        """
        return run(_prepared(self._parts, body, headers), self._parts.jobs)

    async def aprepare(self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> Attempt:
        """The async twin of :meth:`prepare` (the count is awaited; a warm runs as a task)."""
        return await arun(_prepared(self._parts, body, headers), self._parts.jobs)

    def presend(self, body: Mapping[str, Any]) -> Attempt | None:
        """The try a request is certain to get, decided before it is counted, or None when that is not certain.

        Certain means: fast, as it is (no clamp), and far from every boundary (the route, the clamp, warm-ahead,
        by :func:`~agentkv.routing.interval_decides`) for any count up to the payload's byte ceiling
        (:mod:`agentkv.tokens.ceiling`, trusted once fast's exact counts have held within theirs), on windows
        discovered within the last second. A caller may then send the request at once and call
        :meth:`aprepare` while the backend works: it counts, logs, records and warms as always, and its attempt
        is what the request should have been (the caller compares the two, and re-sends when they differ).
        Nothing is recorded here, and nothing is ever raised: a request this cannot vouch for gets None."""
        return outside.presend(self._parts, body)

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
        return run(turn(self._parts, attempt, send, streamed=streamed, retries=retries), self._parts.jobs)

    async def aturn(self, attempt: Attempt, send: Callable[[Attempt], Awaitable[T]], *,
                    streamed: bool = False, retries: bool = True) -> TurnEnd[T]:
        """The async twin of :meth:`turn`."""
        return await arun(turn(self._parts, attempt, send, streamed=streamed, retries=retries), self._parts.jobs)

    def recover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The next try after ``attempt`` failed with ``error`` (one step of :meth:`turn`): a recoverable overflow is
        clamped or escalated, an outage fails over when the other backend can take it; anything else is re-raised."""
        return _moved(run(_recovery(self._parts, attempt, error), self._parts.jobs))

    async def arecover(self, attempt: Attempt, error: Exception) -> Attempt:
        """The async twin of :meth:`recover`."""
        return _moved(await arun(_recovery(self._parts, attempt, error), self._parts.jobs))

    def answered(self, attempt: Attempt, response: Any) -> Any:
        """Record ``attempt`` as answered with ``response`` (a dict or object with OpenAI's ``usage``):
        requests per backend, the ledger row, the escalation and its cached tokens, as :meth:`completion`. For a
        prepared (:meth:`prepare`) streamed request, call it once the stream has ended, with its usage chunk (or an
        object holding its ``usage``), as the gateway and the OpenAI transport do."""
        return run(steps.finish(self._parts, attempt, response), self._parts.jobs)  # its background: tasks on a loop

    # ----------------------------------------------------------------- a request sent elsewhere, or none

    def observe(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """Account a request sent outside the Session (a LangChain callback, a litellm logger).

        The request is counted and recorded in the ledger (as sent to ``sent_to``, "fast" or "slow"),
        and warm-ahead fires when due; nothing else is sent. The returned :class:`Observation` says
        whether fast can take the request as it is.
        """
        return run(_observed(self._parts, sent_to, kwargs), self._parts.jobs)

    async def aobserve(self, *, sent_to: str = "fast", **kwargs: Any) -> Observation:
        """The async twin of :meth:`observe` (warms run as tasks)."""
        return await arun(_observed(self._parts, sent_to, kwargs), self._parts.jobs)

    def route(self, **kwargs: Any) -> RouteDecision:
        """The route this Session would choose for a request, sending and recording nothing.

        Raises :class:`ContextOverflowError` when no backend can hold it.
        """
        return run(_routed(self._parts, kwargs), self._parts.jobs)

    async def aroute(self, **kwargs: Any) -> RouteDecision:
        """The async twin of :meth:`route`."""
        return await arun(_routed(self._parts, kwargs), self._parts.jobs)

    def count(self, **kwargs: Any) -> TokenCount:
        """Count a request as the fast backend will receive it, without sending anything."""
        p = self._parts
        return p.counter(p.fast).count(request_payload(kwargs, p.backends(), p.counters.values()))

    def record_usage(self, turn: int, *, cached_tokens: int | None) -> None:
        """Attach a response's cached-token count to an observed ledger turn."""
        self._parts.recorder.record_usage(turn, cached_tokens)

    def react(self, user_message: Any, tools: Any = None, *, max_steps: int = 20, **kwargs: Any) -> Any:
        """Run a ReAct loop (a tool-calling agent loop) through this Session's routing (see :func:`agentkv.react.run_loop`)."""
        from agentkv.react import run_loop

        return run_loop(self, user_message, tools, max_steps=max_steps, **kwargs)

    async def areact(self, user_message: Any, tools: Any = None, *, max_steps: int = 20, **kwargs: Any) -> Any:
        """The async twin of :meth:`react` (see :func:`agentkv.react.arun_loop`)."""
        from agentkv.react import arun_loop

        return await arun_loop(self, user_message, tools, max_steps=max_steps, **kwargs)

    @property
    def ledger(self) -> list[LedgerEntry]:
        """One row per request (the latest ``ledger_rows`` of them when bounded): tokens, the tool schemas' share,
        count source, route, warm-ahead, cached tokens."""
        return self._parts.recorder.ledger

    def write_ledger(self, path: str | Path) -> Path:
        """Write :attr:`ledger` (and fast's window, the output floor and the warm-ahead threshold) to ``path`` as JSON
        lines, for ``agentkv report`` (:mod:`agentkv.report`): sizes, routes and cache figures, no prompt text."""
        from agentkv.report import write_ledger

        p = self._parts
        threshold = p.warm_ahead.threshold if p.slow is not None else None
        return write_ledger(path, self.ledger, fast_window=run(gather.facts(p), p.jobs).fast.window,
                            output_floor=p.routing.output_floor, warm_threshold=threshold)

    def stats(self) -> dict[str, Any]:
        """Plain dict of counters: requests per backend, routes, clamps, fallbacks, warms, cached tokens."""
        return self._parts.session_stats.snapshot()

    def prefix_report(self) -> PrefixReport | None:
        """Compare the rendered token prefixes of the last two requests (None before the second)."""
        return run(_prefix_report(self._parts), self._parts.jobs)

    async def aprefix_report(self) -> PrefixReport | None:
        """The async twin of :meth:`prefix_report`."""
        return await arun(_prefix_report(self._parts), self._parts.jobs)

    def drain_warms(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` for this Session's background work on threads (warms, diagnostics);
        True when none is left. For tests, benchmarks and demos: requests never wait for it."""
        return self._parts.jobs.drain(timeout_s)

    async def adrain_warms(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for this Session's background tasks (tests, benchmarks, demos)."""
        await self._parts.jobs.adrain(timeout_s)


Session.__signature__ = session_signature()  # type: ignore[attr-defined]  # what help() and inspect show


def _client_call(attempt: Attempt) -> dict[str, Any]:
    """This try's litellm kwargs with the client's own retries off: the Session's :class:`RetryPolicy` is the one
    bound."""
    return {**attempt.call_kwargs, **CLIENT_RETRIES_OFF}

# ----------------------------------------------------------------- the entry points' machines (each run by both drivers)

def _completion(p: SessionParts, kwargs: dict[str, Any], send: Callable[[Attempt], Any]) -> Machine[Any]:
    kwargs = dict(p.sends(p.fast.model, kwargs))
    payload = steps.open_request(p, kwargs)
    attempt = yield from opening(p, kwargs, payload)
    end = yield from turn(p, attempt, send, streamed=bool(kwargs.get("stream")))
    return (yield from steps.finish(p, end.attempt, end.result()))


def _prepared(p: SessionParts, body: Mapping[str, Any], headers: Mapping[str, str] | None) -> Machine[Attempt]:
    check_headers(headers, "headers")  # before anything is counted or sent
    kwargs = counted_view(body)  # what is counted and warmed: the body without its streaming switches
    payload = steps.open_request(p, kwargs, text=True)
    return (yield from opening(p, kwargs, payload, headers=headers, raw_body=dict(body)))


def _recovery(p: SessionParts, attempt: Attempt, error: Exception) -> Machine[Attempt | GiveUp]:
    action = steps.next_step(p, attempt, Failed(error))
    if isinstance(action, (Recover, FailOver)):
        return (yield from next_try(p, attempt, action))
    return GiveUp(error)


def _moved(moved: Attempt | GiveUp) -> Attempt:
    """The next try, or raise what ended the turn (the public :meth:`Session.recover` contract)."""
    if isinstance(moved, GiveUp):
        raise moved.error
    return moved


def _observed(p: SessionParts, sent_to: str, kwargs: dict[str, Any]) -> Machine[Observation]:
    role = outside.sent_to_role(p, sent_to)
    payload = steps.open_request(p, kwargs)
    known = yield from gather.facts(p)
    counted = yield from gather.count(p, kwargs, payload, known)
    attempt, decision = outside.observed(p, kwargs, payload, counted, known, role)
    yield from warming.maybe_warm(p, attempt, known)
    yield from gather.watch_warm_replica(p, attempt)
    return outside.observation(p, attempt, decision, known)


def _routed(p: SessionParts, kwargs: dict[str, Any]) -> Machine[RouteDecision]:
    payload = request_payload(kwargs, p.backends(), p.counters.values())
    known = yield from gather.facts(p)
    counted = yield from gather.count(p, kwargs, payload, known)
    return steps.decide(p, kwargs, counted, known)


def _prefix_report(p: SessionParts) -> Machine[PrefixReport | None]:
    if len(p.history) < 2:
        return None
    previous, current = p.history[-2:]
    counter = p.counter(p.fast)
    before = yield from counter.ids(previous, add_generation_prompt=False)
    now = yield from counter.ids(current)
    return prefix_report(previous, current, before, now)

