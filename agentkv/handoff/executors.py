"""The executors of an :class:`~agentkv.handoff.escalation_plan.EscalationPlan`, one per engine kind.

Each acts only on the plan (and the seams it is handed) and returns a
:class:`~agentkv.handoff.escalation_plan.HandoffOutcome`; none edits the request or reads the Session. The two
that do work are machines (:mod:`agentkv._support.effects`): the torch work and the mapper's files go out as
:class:`Offload` (on a thread under the async driver), the export and the count as :class:`Call`.

    outcome = run(execute(plan, mappers, http=http, warmed=warmed, residency=residency), jobs)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agentkv._support.effects import Call, Machine, Offload
from agentkv.events import emit
from agentkv.handoff.escalation_plan import EscalatedRequest, EscalationPlan, HandoffOutcome
from agentkv.handoff.protocol import REPLAY
from agentkv.http.transport import HttpTransport
from agentkv.tokens import Payload

__all__ = ["Mappers", "execute", "fell_back", "in_process", "over_vllm", "replayed", "slow_cold"]


class Mappers:
    """The configured mapper: loaded once for in-process engines (torch), summarised for the gate over vLLM.

    ``spec``: a saved mapper's folder, a mapper object, or None (the backend's own, e.g. ``identity``).
    """

    def __init__(self, backend: str, spec: Any = None) -> None:
        self.backend, self.spec = backend, spec
        self._loaded: Any = None

    def loaded(self, source_model: Any, target_model: Any) -> Any:
        """The mapper object for the gate and the map (a folder is loaded once, for these two models)."""
        if self._loaded is None:
            from agentkv.handoff.registry import load_mapper

            spec = self.spec if self.spec is not None else self.backend
            self._loaded = load_mapper(spec, source=source_model, target=target_model) \
                if isinstance(spec, (str, Path)) and Path(spec).is_dir() else spec
        return self._loaded

    def summary(self) -> Any:
        """The saved mapper's :class:`~agentkv.handoff.served.MapperSummary` (manifest and digest), None without one."""
        from agentkv.handoff.served import MapperSummary

        return MapperSummary.read(self.spec) if self.spec is not None else None


def execute(plan: EscalationPlan, mappers: Mappers, *, http: HttpTransport | None = None,
            warmed: Payload | None = None, residency: Any = None) -> Machine[HandoffOutcome]:
    """Carry ``plan`` out with the executor of its engine kind. Over vLLM, ``http`` is the seam the export goes
    through, ``warmed`` the prefix warm-ahead last sent to slow and ``residency`` the ledger view of slow (both None
    when there is none): an escalation that finds slow holding the warm hands nothing off."""
    if plan.engine == "embedded":
        return (yield from in_process(plan, mappers))
    if plan.engine == "vllm":
        if http is None:
            return fell_back(plan, "a vLLM handoff needs an HTTP transport")
        return (yield from over_vllm(plan, mappers, http, warmed, residency))
    return replayed(plan)


def replayed(plan: EscalationPlan) -> HandoffOutcome:
    """A replay plan's outcome (the slow engine prefills the tokens), logged as the plan's reason says."""
    if plan.fallback:
        return fell_back(plan, plan.reason)
    emit("handoff.plan", backend=REPLAY, reason=plan.reason)
    return HandoffOutcome(0, REPLAY, plan.reason)


def fell_back(plan: EscalationPlan, reason: str) -> HandoffOutcome:
    """The replay that stands in for ``plan``'s mapper, and why (a handoff never fails the request)."""
    emit("handoff.fallback", level="warning", backend=REPLAY, configured=plan.backend, reason=reason)
    return HandoffOutcome(0, REPLAY, reason, fallback=True)


def in_process(plan: EscalationPlan, mappers: Mappers) -> Machine[HandoffOutcome]:
    """Map the fast engine's cached prefix into the slow engine, both served in this process (the torch work offloaded)."""
    from agentkv.embedded import engine_at

    source, target = engine_at(plan.fast_url), engine_at(plan.slow_url)
    if source is None or target is None:
        return fell_back(plan, "fast and slow are not both embedded engines in this process")
    try:
        outcome: HandoffOutcome = yield Offload(lambda: _mapped(plan, mappers, source, target))
    except Exception as error:  # a handoff never fails the request: the slow engine prefills instead
        return fell_back(plan, f"{type(error).__name__}: {error}")
    return outcome


def _mapped(plan: EscalationPlan, mappers: Mappers, source: Any, target: Any) -> HandoffOutcome:
    """The gate on the loaded mapper and both engines' signatures, then the map (torch: CPU-bound)."""
    from agentkv.handoff.engines import engine_signature, handoff_prefix
    from agentkv.handoff.plan import choose_handoff, log_plan

    gate = choose_handoff(mappers.loaded(source.model, target.model), plan.min_attention_cosine,
                          source=engine_signature(source), target=engine_signature(target))
    log_plan(gate)
    if gate.replay:
        return HandoffOutcome(0, REPLAY, gate.reason, fallback=gate.fallback)
    payload = plan.prefix
    assert payload is not None
    token_ids = source.tokenize_chat(list(payload.messages or ()), list(payload.tools or ()) or None,
                                     payload.tool_choice, chat_template_kwargs=payload.template_kwargs)
    result = handoff_prefix(source, target, token_ids, gate.mapper, cache_salt=plan.cache_salt)
    return HandoffOutcome(result.mapped_tokens, result.backend, result.reason, fallback=result.replayed)


def over_vllm(plan: EscalationPlan, mappers: Mappers, http: HttpTransport, warmed: Payload | None,
              residency: Any) -> Machine[HandoffOutcome]:
    """Unless slow holds the warmed prefix: the gate on the mapper's summary, fast's export, and the escalated
    request naming it (returned in the outcome, for the caller to send and to count at its answer)."""
    from agentkv.handoff.plan import choose_handoff, log_plan
    from agentkv.handoff.served import import_request

    cold = yield from slow_cold(warmed, residency)
    if cold is None:
        emit("handoff.skipped", reason="slow holds the warmed prefix")
        return HandoffOutcome(0, REPLAY, "slow holds the warmed prefix")
    try:
        summary = yield Offload(mappers.summary)  # reads the manifest and digests the folder's files
    except Exception as error:  # an unreadable mapper is a replay, never a failed request
        return fell_back(plan, f"{type(error).__name__}: {error}")
    gate = choose_handoff(summary if summary is not None else plan.backend, plan.min_attention_cosine)
    log_plan(gate, cold=cold)
    if gate.replay:
        return HandoffOutcome(0, REPLAY, gate.reason, fallback=gate.fallback)
    exported = yield from _export(plan, http)
    if isinstance(exported, HandoffOutcome):
        return exported
    kwargs, salt = import_request(plan.request, exported, summary, plan.cache_salt, mapper_name=plan.mapper_name,
                                  raw=plan.raw)
    return HandoffOutcome(0, gate.backend, f"import of {exported[:12]} sent ({cold})", pending=True,
                          request=EscalatedRequest(kwargs, salt, exported))


def _export(plan: EscalationPlan, http: HttpTransport) -> Machine[str | HandoffOutcome]:
    """Ask fast to export the plan's prefix: the export id, or the fallback outcome when it did not."""
    from agentkv.wire.kv_transfer import export_result

    export = plan.export
    assert export is not None
    started = time.perf_counter()
    try:
        answer = yield Call(http.request, http.arequest, ("POST", export.url),
                            {"json": dict(export.body), "headers": export.headers, "timeout_s": export.timeout_s})
    except Exception as error:  # fast unreachable or refusing: replay
        return fell_back(plan, f"export failed: {type(error).__name__}: {str(error)[:200]}")
    found = export_result(answer.get("kv_transfer_params") if isinstance(answer, dict) else None)
    if found is None:
        return fell_back(plan, "fast exported nothing (no AgentKVConnector there?)")
    emit("handoff.export", backend=plan.fast_label, export=found[0][:12], tokens=found[1],
         export_ms=round((time.perf_counter() - started) * 1e3, 3))
    return found[0]


def slow_cold(warmed: Payload | None, residency: Any) -> Machine[str | None]:
    """Why slow would prefill this escalation cold (see :func:`~agentkv.handoff.served.cold_reason`), asking the
    ledger that follows slow (``residency``, through slow's tokenizer) when there is one; None when slow holds the
    ``warmed`` prefix."""
    from agentkv.handoff.served import cold_reason

    held = tokens = size = None
    if warmed is not None and residency is not None:
        try:
            counter, ledger, backend = residency.counter, residency.ledger, residency.backend
            ids, exact = yield from counter.ids(warmed, add_generation_prompt=False)
            size = ledger.block_size(backend)
            if exact and ledger.live(backend) and size:
                held, tokens = residency.held(ids), len(ids)
        except Exception as exc:  # the ledger cannot tell: trust the warm
            emit("handoff.residency_unknown", level="debug", error=type(exc).__name__)
    return cold_reason(warmed=warmed is not None, held_tokens=held, warmed_tokens=tokens, block_size=size)
