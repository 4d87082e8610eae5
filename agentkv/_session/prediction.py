"""The ledger's prediction for each request, checked against the ``cached_tokens`` its response reports.

A request to a backend the Session's :class:`~agentkv.cache_ledger.CacheLedger` follows is stamped with the
publishers' clock (``time.time()``, as vLLM stamps event batches) when it is planned (``Attempt.sent_at``).
After the answer, off the request path, the
backend's token ids for the prompt are fetched (its ``/tokenize``, or a template declared for it: the
counter's cache answers when the warm's job already asked) and the ledger is read *as of the stamp*:
blocks stored after it, the request's own among them, are ignored. The prediction and the reported
``cached_tokens`` meet in a :class:`Prediction` (whichever arrives second records both, in the ledger and in
the Session's stats; the prompt's length counts toward the ledger's hit rate, :meth:`CacheLedger.stats`).

Limits: a block evicted between the stamp and the read is missing from the ledger, so the prediction can fall
short (never over); the stamp and the publisher's event times are compared, so a server on another host needs
a synchronised clock; a prompt whose exact ids cannot be had (no ``/tokenize``, no template) is not predicted.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from agentkv.backends import Backend
from agentkv.events import emit
from agentkv.stats import SessionStats
from agentkv.tokens import Payload, TokenCounter
from agentkv._support.effects import Machine, Spawn

if TYPE_CHECKING:
    from agentkv.cache_ledger import CacheLedger

__all__ = ["Prediction", "predicting"]

_UNSET = object()


class Prediction:
    """One request's predicted and reported cached tokens; recorded once both are known (any order, any thread)."""

    def __init__(self, ledger: CacheLedger, backend: Backend, stats: SessionStats) -> None:
        self.ledger, self.backend, self.stats = ledger, backend, stats
        self._lock = threading.Lock()
        self._predicted: Any = _UNSET
        self._reported: Any = _UNSET
        self._prompt_tokens = 0

    def predicted(self, tokens: int | None, prompt_tokens: int = 0) -> None:
        """The ledger's prediction (None: it could not be made), and the prompt's length in the backend's tokens."""
        with self._lock:
            self._predicted, self._prompt_tokens = tokens, prompt_tokens
        self._settle()

    def reported(self, tokens: int | None) -> None:
        """The ``cached_tokens`` the response reported (None: it reported none)."""
        with self._lock:
            self._reported = tokens
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            predicted, reported, prompt_tokens = self._predicted, self._reported, self._prompt_tokens
            if predicted is _UNSET or reported is _UNSET:
                return
            self._predicted = self._reported = _UNSET  # record once
        if predicted is None or reported is None:
            self.stats.add("ledger_predictions_unknown")
            return
        self.ledger.record(self.backend, predicted, reported, prompt_tokens=prompt_tokens)
        self.stats.add("ledger_predictions")
        self.stats.add("ledger_predictions_exact", int(predicted == reported))
        self.stats.add("ledger_predicted_tokens", predicted)
        self.stats.add("ledger_reported_tokens", reported)


def _resident(prediction: Prediction, ids: tuple[list[int], bool], salt: str | None, sent_at: float) -> None:
    token_ids, exact = ids
    exact = exact and prediction.ledger.live(prediction.backend)  # a stopped ledger's tree is stale: no prediction
    predicted = prediction.ledger.resident_tokens(prediction.backend, token_ids, salt, as_of=sent_at) if exact else None
    prediction.predicted(predicted, len(token_ids) if exact else 0)


def predicting(prediction: Prediction, counter: TokenCounter, payload: Payload, salt: str | None,
               sent_at: float) -> Machine[None]:
    """Work the prediction out in the background (spawned: a task on the running loop, or a pool thread)."""
    yield Spawn(functools.partial(_predict, prediction, counter, payload, salt, sent_at), 60.0)


def _predict(prediction: Prediction, counter: TokenCounter, payload: Payload, salt: str | None,
             sent_at: float) -> Machine[None]:
    try:
        ids = yield from counter.ids(payload)
        _resident(prediction, ids, salt, sent_at)
    except Exception as exc:  # a prediction never raises into anyone
        emit("ledger.prediction_failed", level="debug", error=type(exc).__name__)
        prediction.predicted(None)
