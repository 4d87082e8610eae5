"""KV handoff: move a conversation's KV cache from one model to another, or replay its tokens.

The default backend, ``replay``, moves no bytes: the target re-prefills the tokens and its prefix
cache does the work. A mapper backend (``identity``, ``ridge``, ``mlp`` or a third party's, see
:class:`KVMapper`) turns the source's KV into the target's; a quality gate (:func:`choose_handoff`)
falls back to ``replay`` when a mapper's held-out attention-output cosine is too low.

What runs at an escalation (here: :class:`Handoff`, the registry, the plan, the mappers' ``map``) is apart from
what runs offline to make a mapper (:mod:`agentkv.handoff.offline`: collect, rank, fit, evaluate, bench, the CLI): a
process that only maps, such as the KV connector inside vLLM, imports none of the offline code. Importing this
package does not import torch; the torch-backed names below (``calibrate``, ``evaluate``, ``fit_store``,
``RidgeMapper``, ``MLPMapper``, ``Evaluation``) and the calibration settings load on first access.

    mapper = load_mapper("mappers/small-to-large", source=fast_model, target=slow_model)
    plan = choose_handoff(mapper, min_attention_cosine=0.95)
    result = handoff_prefix(fast_engine, slow_engine, token_ids, plan.mapper, cache_salt=salt)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv._support.lazy import lazy_exports

if TYPE_CHECKING:
    from agentkv.handoff.cache import KVCache
    from agentkv.handoff.engines import HandoffResult
    from agentkv.handoff.engines import handoff_prefix
    from agentkv.handoff.escalation import Handoff
    from agentkv.handoff.escalation_plan import EscalatedRequest
    from agentkv.handoff.escalation_plan import EscalationPlan
    from agentkv.handoff.escalation_plan import HandoffOutcome
    from agentkv.handoff.escalation_plan import plan_escalation
    from agentkv.handoff.errors import HandoffError
    from agentkv.handoff.errors import MapperFileError
    from agentkv.handoff.errors import NotMappableError
    from agentkv.handoff.errors import SignatureMismatchError
    from agentkv.handoff.errors import UnknownMapperError
    from agentkv.handoff.plan import DEFAULT_MIN_ATTENTION_COSINE
    from agentkv.handoff.plan import HandoffPlan
    from agentkv.handoff.plan import choose_handoff
    from agentkv.handoff.plan import log_plan
    from agentkv.handoff.protocol import KVMapper
    from agentkv.handoff.registry import ENTRY_POINT_GROUP
    from agentkv.handoff.registry import available_mappers
    from agentkv.handoff.registry import create_mapper
    from agentkv.handoff.registry import get_factory
    from agentkv.handoff.registry import load_mapper
    from agentkv.handoff.registry import register_mapper
    from agentkv.handoff.registry import unregister_mapper
    from agentkv.handoff.signature import ModelSignature
    from agentkv.handoff.signature import SignaturePair
    from agentkv.handoff.offline.calibration import calibrate, fit_store
    from agentkv.handoff.offline.config import CalibrationConfig, MLPConfig
    from agentkv.handoff.offline.evaluation import Evaluation, evaluate
    from agentkv.handoff.mlp import MLPMapper
    from agentkv.handoff.ridge import RidgeMapper

_LAZY = {
    "KVCache": "agentkv.handoff.cache",
    "HandoffResult": "agentkv.handoff.engines",
    "handoff_prefix": "agentkv.handoff.engines",
    "Handoff": "agentkv.handoff.escalation",
    "EscalatedRequest": "agentkv.handoff.escalation_plan",
    "EscalationPlan": "agentkv.handoff.escalation_plan",
    "HandoffOutcome": "agentkv.handoff.escalation_plan",
    "plan_escalation": "agentkv.handoff.escalation_plan",
    "HandoffError": "agentkv.handoff.errors",
    "MapperFileError": "agentkv.handoff.errors",
    "NotMappableError": "agentkv.handoff.errors",
    "SignatureMismatchError": "agentkv.handoff.errors",
    "UnknownMapperError": "agentkv.handoff.errors",
    "DEFAULT_MIN_ATTENTION_COSINE": "agentkv.handoff.plan",
    "HandoffPlan": "agentkv.handoff.plan",
    "choose_handoff": "agentkv.handoff.plan",
    "log_plan": "agentkv.handoff.plan",
    "KVMapper": "agentkv.handoff.protocol",
    "ENTRY_POINT_GROUP": "agentkv.handoff.registry",
    "available_mappers": "agentkv.handoff.registry",
    "create_mapper": "agentkv.handoff.registry",
    "get_factory": "agentkv.handoff.registry",
    "load_mapper": "agentkv.handoff.registry",
    "register_mapper": "agentkv.handoff.registry",
    "unregister_mapper": "agentkv.handoff.registry",
    "ModelSignature": "agentkv.handoff.signature",
    "SignaturePair": "agentkv.handoff.signature",
    "CalibrationConfig": "agentkv.handoff.offline.config",
    "MLPConfig": "agentkv.handoff.offline.config",
    "calibrate": "agentkv.handoff.offline.calibration",
    "fit_store": "agentkv.handoff.offline.calibration",
    "evaluate": "agentkv.handoff.offline.evaluation",
    "Evaluation": "agentkv.handoff.offline.evaluation",
    "RidgeMapper": "agentkv.handoff.ridge",
    "MLPMapper": "agentkv.handoff.mlp",
}

__all__ = [
    "DEFAULT_MIN_ATTENTION_COSINE",
    "ENTRY_POINT_GROUP",
    "CalibrationConfig",
    "EscalatedRequest",
    "EscalationPlan",
    "Evaluation",
    "Handoff",
    "HandoffError",
    "HandoffOutcome",
    "HandoffPlan",
    "HandoffResult",
    "KVCache",
    "KVMapper",
    "MLPConfig",
    "MLPMapper",
    "MapperFileError",
    "ModelSignature",
    "NotMappableError",
    "RidgeMapper",
    "SignatureMismatchError",
    "SignaturePair",
    "UnknownMapperError",
    "available_mappers",
    "calibrate",
    "choose_handoff",
    "create_mapper",
    "evaluate",
    "fit_store",
    "get_factory",
    "handoff_prefix",
    "load_mapper",
    "log_plan",
    "plan_escalation",
    "register_mapper",
    "unregister_mapper",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
