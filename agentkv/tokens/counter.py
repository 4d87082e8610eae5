"""Token accounting: count exactly what the backend will receive, incrementally, turn by turn.

Sources, best first (a :class:`TokenCounter` tries them in order and says which one answered):

1. ``template``: the backend's own tokenizer and chat template (a tiktoken encoding name or a
   transformers tokenizer, with a Jinja template). Exact.
2. ``server``: vLLM's ``POST /tokenize`` chat form. Exact; cached per payload.
3. ``tiktoken``: cl100k_base plus the ChatML template's per-message overhead. Approximate.
4. ``chars``: character estimators with a written-down bias: ``chars / 4`` under-estimates (used for
   routing, where being wrong must be cheap) and ``chars / 3`` over-estimates (used for clamping the
   output budget, where being wrong must be safe).

A payload with both ``messages`` and ``prompt`` counts the messages only: that is what the payload
builder sends (:func:`payload_from_request`).

Estimate first (:meth:`TokenCounter.count_for`): the local sources (template, tiktoken, characters)
answer at once with an interval that holds the exact count (:attr:`TokenCount.interval`); the server
is asked only when the caller's ``decides(low, high)`` says a decision could change inside it
(:func:`agentkv.routing.interval_decides`), and for a backend's first request in the process, before any exact
count has shown how far its tokenizer is from the estimate's (:mod:`agentkv.tokens.bound`, which every exact
count teaches: :meth:`TokenCounter.learn`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from agentkv._support.effects import Machine, run
from agentkv.http.transport import HttpTransport
from agentkv.backends import Backend
from agentkv.events import emit
from agentkv.tokens.bound import EstimateBound, shared_bound
from agentkv.tokens.breaker import CircuitBreaker
from agentkv.tokens.ceiling import byte_ceiling
from agentkv.tokens.encodings import DEFAULT_ENCODING
from agentkv.tokens.payload import CountUnavailable, Payload, TokenCount, TokenSource
from agentkv.tokens.sources import (
    provider_source,
    DEFAULT_TOKENIZE_TIMEOUT_S, CharSource, ServerSource, TemplateSource, TiktokenSource,
)

__all__ = ["TokenCounter"]


class TokenCounter:
    """Counts payloads for one backend, trying its sources best first and saying which answered."""

    def __init__(self, sources: Sequence[TokenSource], *, backend_label: str = "", estimate_first: bool = True,
                 bound: EstimateBound | None = None) -> None:
        if not sources:
            raise ValueError("a TokenCounter needs at least one source")
        self.sources = list(sources)
        self._label = backend_label
        self.estimate_first = estimate_first
        self.exact_asked = 0  # how often count_for asked past the estimate
        # how far estimate intervals are widened, learned from exact counts outside them (see tokens.bound)
        self.bound = bound if bound is not None else EstimateBound()
        # the last payload's local count and byte ceiling, by identity (a request's answer re-reads both)
        self._last_estimate: tuple[Payload, TokenCount] | None = None
        self._last_ceiling: tuple[Payload, int | None] | None = None

    @classmethod
    def for_backend(cls, backend: Backend, *, use_server: bool = True, http: HttpTransport | None = None,
                    estimate_first: bool = True, tokenize_timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S,
                    breaker: CircuitBreaker | None = None) -> "TokenCounter":
        """The ladder for ``backend``: its template, its server's /tokenize (a hosted provider's count endpoint:
        :mod:`agentkv.tokens.sources.provider`), tiktoken, characters.

        ``estimate_first``: :meth:`count_for` asks the server only where a decision depends on it
        (False: always, the all-exact path); ``tokenize_timeout_s`` and ``breaker`` configure the
        server source (:class:`~agentkv.tokens.ServerSource`)."""
        sources: list[TokenSource | None] = []
        if backend.tokenizer is not None:
            sources.append(TemplateSource(backend.tokenizer, backend.chat_template))
        if use_server and backend.self_hosted and backend.server_root is not None:
            sources.append(ServerSource(backend, http=http, timeout_s=tokenize_timeout_s, breaker=breaker))
        elif use_server:  # a hosted provider's count endpoint, where it has one
            sources.append(provider_source(backend, http=http, timeout_s=tokenize_timeout_s, breaker=breaker))
        sources += [_tiktoken_or_none(), CharSource()]
        return cls([s for s in sources if s is not None], backend_label=backend.label, estimate_first=estimate_first,
                   bound=shared_bound(f"{backend.server_root or backend.label}|{backend.served_model}"))

    def estimate(self, payload: Payload) -> TokenCount:
        """The best count the local sources give (exact from a declared template), with its interval and safe
        figure widened by :attr:`bound` after exact counts fell outside earlier ones."""
        last = self._last_estimate
        if last is not None and last[0] is payload:  # the same request again (its answer teaching the bound)
            return self.bound.apply(last[1])
        local = _first_count([s for s in self.sources if not isinstance(s, ServerSource)], payload, self._label)
        self._last_estimate = (payload, local)
        return self.bound.apply(local)

    def count_for(self, payload: Payload, decides: Callable[[int, int], bool]) -> TokenCount:
        """The estimate when ``decides(low, high)`` says its interval is enough, else :meth:`count`."""
        return run(self.counting_for(payload, decides))

    def counting_for(self, payload: Payload, decides: Callable[[int, int], bool]) -> Machine[TokenCount]:
        """:meth:`count_for` as a machine (a server's count an effect): the Session's turn yields from it."""
        estimate = self.estimate(payload)
        if self._estimate_suffices(estimate, payload, decides):
            return estimate
        self.exact_asked += 1
        return self._checked(estimate, payload, (yield from self.counting(payload)))

    def learn(self, payload: Payload, exact: int, *, origin: str = "usage", session: str | None = None) -> bool:
        """Teach :attr:`bound` an exact count of ``payload`` taken elsewhere (a response's ``usage.prompt_tokens``,
        a claim of ``session``'s answer; the count taken while recovering from an overflow); True when the bound
        widened (see :meth:`EstimateBound.learn`)."""
        self._check_ceiling(payload, exact, origin, session)
        return self.bound.learn(self.estimate(payload), exact, backend=self._label, origin=origin, session=session)

    def _check_ceiling(self, payload: Payload, exact: int, origin: str, session: str | None = None) -> None:
        """While the ratio is unknown (when a ceiling decides a count), or before any ceiling was checked (a ceiling
        decides whether a request may be sent before it is counted: Session.presend), check ``exact`` against the
        payload's ceiling."""
        bound = self.bound
        if (not bound.known or not bound.ceilings_checked) and not bound.ceiling_broken:
            self.bound.check_ceiling(self._ceiling(payload), exact, backend=self._label, origin=origin, session=session)

    def _ceiling(self, payload: Payload) -> int | None:
        last = self._last_ceiling
        if last is not None and last[0] is payload:
            return last[1]
        ceiling = byte_ceiling(payload)
        self._last_ceiling = (payload, ceiling)
        return ceiling

    def _checked(self, estimate: TokenCount, payload: Payload, counted: TokenCount) -> TokenCount:
        """When an exact count falls outside the estimate's interval (the bound's assumption failed), say so and
        widen later intervals so that this count would have fallen inside (:class:`EstimateBound`); when no
        exact source answered, the (widened) estimate."""
        if not counted.exact:
            return estimate
        self._check_ceiling(payload, counted.total, "tokenize")
        self.bound.learn(estimate, counted.total, backend=self._label, origin="tokenize")
        return counted

    def _estimate_suffices(self, estimate: TokenCount, payload: Payload, decides: Callable[[int, int], bool]) -> bool:
        """The estimate is enough when it is exact, when no exact source exists, or when ``decides`` says so of:
        its interval, once an exact count of this backend has told its ratio (:attr:`EstimateBound.known`); else,
        once exact counts have held within their ceilings, ``[0, byte ceiling]`` (:mod:`agentkv.tokens.ceiling`:
        a short request far from every boundary needs no ``/tokenize``). A backend's first request is counted
        exactly."""
        if estimate.exact or not any(isinstance(s, ServerSource) and not s.unsupported for s in self.sources):
            return True
        bound = self.bound
        if not self.estimate_first or bound.exhausted:
            return False
        if bound.known:
            return decides(*estimate.interval)
        if not bound.trusts_ceiling:
            return False
        ceiling = self._ceiling(payload)
        return ceiling is not None and decides(0, max(ceiling, estimate.interval[1]))

    def count(self, payload: Payload) -> TokenCount:
        """The best count any source can give; a failing source is logged and skipped."""
        return run(self.counting(payload))

    def counting(self, payload: Payload) -> Machine[TokenCount]:
        """:meth:`count` as a machine: a server source's count is an effect."""
        for source in self.sources:
            try:
                if isinstance(source, ServerSource):
                    return (yield from source.counting(payload))
                return source.count(payload)
            except CountUnavailable as exc:
                emit("count_source_unavailable", level="debug", backend=self._label, source=source.name, reason=str(exc))
        raise AssertionError("CharSource never fails")  # pragma: no cover

    def token_ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> tuple[list[int], bool]:
        """Rendered token ids and whether they are exact (a cl100k/ChatML rendering otherwise)."""
        return run(self.ids(payload, add_generation_prompt=add_generation_prompt))

    def ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> Machine[tuple[list[int], bool]]:
        """:meth:`token_ids` as a machine: the server's ids are an effect."""
        for source in self._id_sources():
            try:
                if isinstance(source, ServerSource):
                    return (yield from source.ids(payload, add_generation_prompt=add_generation_prompt)), True
                return source.token_ids(payload, add_generation_prompt=add_generation_prompt), True
            except CountUnavailable:
                continue
        return _approximate_ids(payload, add_generation_prompt), False

    def _id_sources(self) -> list[TemplateSource | ServerSource]:
        return [s for s in self.sources if isinstance(s, (TemplateSource, ServerSource))]

    @property
    def chat_template(self) -> str | None:
        """The chat template the exact local source renders with (None without a declared tokenizer: the
        server's own template is not known here)."""
        for source in self.sources:
            if isinstance(source, TemplateSource):
                return source.chat_template
        return None


def _first_count(sources: Sequence[TokenSource], payload: Payload, label: str) -> TokenCount:
    for source in sources:
        try:
            return source.count(payload)
        except CountUnavailable as exc:
            emit("count_source_unavailable", level="debug", backend=label, source=source.name, reason=str(exc))
    raise AssertionError("CharSource never fails")  # pragma: no cover


def _approximate_ids(payload: Payload, add_generation_prompt: bool) -> list[int]:
    return TemplateSource(DEFAULT_ENCODING).token_ids(payload, add_generation_prompt=add_generation_prompt)


def _tiktoken_or_none() -> TokenSource | None:
    try:
        return TiktokenSource()
    except Exception as exc:  # no offline encoding: the character estimators still work
        emit("tiktoken_unavailable", level="warning", reason=f"{type(exc).__name__}: {exc}")
        return None
