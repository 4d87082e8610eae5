"""What a Session does at the escalation besides the request: the KV handoff (:class:`Handoff`).

At the move from fast to slow, a configured mapper (``Session(..., handoff=Handoff("ridge", mapper=PATH))``)
takes the fast engine's cached KV for the conversation's prefix, maps it, and installs it in the slow
engine's prefix cache under the slow engine's own block hashes; the slow engine then prefills only the
unmapped tail. Anything that stops that (engines not in this process, a mapper below the quality gate,
a signature mismatch) falls back to ``replay`` -- the slow engine prefills the tokens itself -- with a
logged reason. A handoff never fails the request.

With ``Handoff(..., via="vllm")`` the two backends are vLLM servers running
:class:`~agentkv.vllm_plugin.connector.AgentKVConnector` (the slow one configured with the same mapper folder under
``mapper_name``). At an escalation that would otherwise be cold (no warm-ahead reached slow, or the ledger shows
it evicted), fast exports the conversation's prefix, the gate reads the mapper's held-out figures, and the
escalated request names the export under the handoff salt; slow maps and loads it. The export a request names
travels with that request (the outcome's :class:`~agentkv.handoff.escalation_plan.EscalatedRequest`, kept by the
caller), so escalations in flight at once each count their own: what slow reports having loaded is counted when
that request's answer arrives (:meth:`Handoff.answered`): ``handoff_mapped``, ``mapped_tokens``, or a
``handoff_fallbacks`` when it loaded nothing.

The handoff is a plan and an executor, as vLLM's connector splits its scheduler and worker halves:
:meth:`Handoff.plan` decides from plain data (:func:`~agentkv.handoff.escalation_plan.plan_escalation`), and
:meth:`Handoff.execute` carries the plan out with the executor of its engine kind
(:mod:`agentkv.handoff.executors`), a machine run by :func:`agentkv._support.effects.run` or ``arun``.

    plan = handoff.plan(fast, slow, payload, salt, previous=last_served, request=kwargs)
    outcome = run(handoff.execute(plan, http=http, warmed=warmed, residency=residency), jobs)
    outcome.request        # an import: the kwargs, salt and export id the escalated request must carry
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from agentkv._support.effects import Machine
from agentkv.backends import Backend
from agentkv.errors import ConfigurationError
from agentkv.events import emit
from agentkv.handoff.escalation_plan import EscalationPlan, HandoffOutcome, plan_escalation
from agentkv.handoff.executors import Mappers, execute
from agentkv.handoff.protocol import DEFAULT_MIN_ATTENTION_COSINE, REPLAY
from agentkv.http.transport import HttpTransport
from agentkv.stats import SessionStats
from agentkv.tokens import Payload

__all__ = ["EscalationPlan", "Handoff", "HandoffOutcome"]


class Handoff:
    """A Session's handoff configuration and the mapper it loads on first use.

        Handoff("ridge", mapper="mappers/small-to-large", min_attention_cosine=0.95)
    """

    def __init__(self, backend: str = REPLAY, mapper: Any = None, *, min_attention_cosine: float | None = None,
                 via: str = "engines", mapper_name: str | None = None, export_timeout_s: float = 60.0) -> None:
        if backend != REPLAY:  # replay is always there: the registry (and its entry points) load for a mapper only
            from agentkv.handoff.registry import available_mappers

            if backend not in available_mappers():
                raise ConfigurationError(f"handoff={backend!r} is not a registered KV mapper; have {available_mappers()}")
        if backend not in (REPLAY, "identity") and mapper is None:
            raise ConfigurationError(f"handoff={backend!r} needs mapper= (a saved mapper directory or a KVMapper)")
        if via not in ("engines", "vllm"):
            raise ConfigurationError(f"Handoff(via={via!r}): 'engines' (in-process) or 'vllm' (AgentKVConnector)")
        if via == "vllm" and mapper is not None and not (isinstance(mapper, (str, Path)) and Path(mapper).is_dir()):
            raise ConfigurationError("Handoff(via='vllm') needs mapper= as the folder the slow server loads too")
        self.backend = backend
        self._mappers = Mappers(backend, mapper)
        self.min_attention_cosine = DEFAULT_MIN_ATTENTION_COSINE if min_attention_cosine is None else min_attention_cosine
        self.via, self.mapper_name, self.export_timeout_s = via, mapper_name, export_timeout_s

    @property
    def active(self) -> bool:
        """False for ``replay``: nothing to do at escalation."""
        return self.backend != REPLAY

    def plan(self, fast: Backend, slow: Backend, payload: Payload, cache_salt: str | None, *,
             previous: Payload | None = None, headers: Mapping[str, str] | None = None,
             request: Mapping[str, Any] | None = None, raw: bool = False) -> EscalationPlan:
        """What the handoff at this escalation will do (pure): see
        :func:`~agentkv.handoff.escalation_plan.plan_escalation`. ``request``/``raw``: the escalated request's
        kwargs, which a vLLM import edits (in the outcome, never in place)."""
        return plan_escalation(fast, slow, payload, cache_salt, backend=self.backend, via=self.via,
                               min_attention_cosine=self.min_attention_cosine, previous=previous, headers=headers,
                               request=request, raw=raw, mapper_name=self.mapper_name,
                               export_timeout_s=self.export_timeout_s)

    def execute(self, plan: EscalationPlan, *, http: HttpTransport | None = None, warmed: Payload | None = None,
                residency: Any = None) -> Machine[HandoffOutcome]:
        """Carry ``plan`` out (a machine: ``yield from`` it in a step, or run it with a driver): see
        :func:`~agentkv.handoff.executors.execute`."""
        return execute(plan, self._mappers, http=http, warmed=warmed, residency=residency)

    def answered(self, export: str | None, response: Any, stats: SessionStats) -> None:
        """Count what slow reported loading for ``export``, the import the answered request named (None: none)."""
        if export is None:
            return
        from agentkv.wire.kv_transfer import import_result

        params = response.get("kv_transfer_params") if isinstance(response, dict) else \
            getattr(response, "kv_transfer_params", None)
        reported = import_result(params)
        if reported is None:  # a stream, or a slow server without the connector: nothing to count
            emit("handoff.unreported", level="warning", backend=self.backend, export=export[:12])
            return
        tokens, reason = reported
        stats.add("handoff_mapped" if tokens > 0 else "handoff_fallbacks")
        stats.add("mapped_tokens", tokens)
        event, level = ("handoff.imported", "info") if tokens > 0 else ("handoff.fallback", "warning")
        emit(event, level=level, backend=self.backend, export=export[:12], mapped_tokens=tokens, reason=reason)

