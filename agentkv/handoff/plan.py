"""The quality gate: a pure decision of whether a handoff maps KV or replays tokens.

    plan = choose_handoff(mapper, min_attention_cosine=0.95, source=src_sig, target=tgt_sig)
    if plan.replay: ...            # send tokens; plan.reason says why
    else: plan.mapper.map(cache)
    log_plan(plan)                 # the structlog event, emitted by whoever carries the plan out
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from agentkv.handoff.protocol import DEFAULT_MIN_ATTENTION_COSINE, REPLAY, KVMapper
from agentkv.handoff.registry import create_mapper
from agentkv.handoff.signature import ModelSignature

__all__ = ["DEFAULT_MIN_ATTENTION_COSINE", "REPLAY", "HandoffPlan", "choose_handoff", "log_plan"]


@dataclass(frozen=True)
class HandoffPlan:
    """What a handoff will do: map with ``mapper`` under ``backend``, or replay tokens (``mapper`` None)."""

    backend: str
    reason: str
    mapper: KVMapper | None = None
    fallback: bool = False

    @property
    def replay(self) -> bool:
        """True when the target re-prefills the tokens itself."""
        return self.mapper is None


@dataclass(frozen=True)
class GateInput:
    """What the checks look at: the mapper, the cosine floor and the models at hand (if known)."""

    mapper: KVMapper
    floor: float
    source: ModelSignature | None = None
    target: ModelSignature | None = None


Check = Callable[[GateInput], Union[str, None]]


def _moves_kv(gate: GateInput) -> str | None:
    return None if gate.mapper.moves_kv else f"backend {gate.mapper.name!r} moves tokens, not KV"


def _fits_source(gate: GateInput) -> str | None:
    pair = gate.mapper.signature_pair
    reason = None if pair is None or gate.source is None else pair.source.mismatch(gate.source)
    return None if reason is None else f"mapper source does not match: {reason}"


def _fits_target(gate: GateInput) -> str | None:
    pair = gate.mapper.signature_pair
    reason = None if pair is None or gate.target is None else pair.target.mismatch(gate.target)
    return None if reason is None else f"mapper target does not match: {reason}"


def _measured(gate: GateInput) -> str | None:
    return None if gate.mapper.attention_cosine is not None else "mapper has no held-out attention cosine"


def _above_floor(gate: GateInput) -> str | None:
    cosine = float(gate.mapper.attention_cosine or 0.0)
    if cosine >= gate.floor:
        return None
    return f"held-out attention cosine {cosine:.4f} < min_attention_cosine {gate.floor:.4f}"


CHECKS: tuple[Check, ...] = (_moves_kv, _fits_source, _fits_target, _measured, _above_floor)


def choose_handoff(
    mapper_or_name: KVMapper | str | None,
    min_attention_cosine: float = DEFAULT_MIN_ATTENTION_COSINE,
    *,
    source: ModelSignature | None = None,
    target: ModelSignature | None = None,
) -> HandoffPlan:
    """Map with the mapper if it passes every check in :data:`CHECKS`, else replay with the first reason.

    ``mapper_or_name`` is a mapper, the name of one that needs no file (``"identity"``), or
    None / ``"replay"``. ``source``/``target``, when given, must match the mapper's signatures.
    """
    if mapper_or_name is None or mapper_or_name == REPLAY:
        return HandoffPlan(REPLAY, "replay configured")
    mapper = create_mapper(mapper_or_name) if isinstance(mapper_or_name, str) else mapper_or_name
    gate = GateInput(mapper, min_attention_cosine, source, target)
    for check in CHECKS:
        reason = check(gate)
        if reason is not None:
            return HandoffPlan(REPLAY, reason, fallback=mapper.moves_kv)
    cosine = mapper.attention_cosine
    return HandoffPlan(mapper.name, f"held-out attention cosine {cosine:.4f} >= {min_attention_cosine:.4f}", mapper)


def log_plan(plan: HandoffPlan, **fields: object) -> None:
    """Emit ``handoff.fallback`` (warning) when a mapper was refused, else ``handoff.plan``."""
    from agentkv.events import emit

    event, level = ("handoff.fallback", "warning") if plan.fallback else ("handoff.plan", "info")
    emit(event, level, backend=plan.backend, reason=plan.reason, **fields)
