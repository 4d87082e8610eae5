"""The client-side KV handoff at an escalation, decided before anything runs: a plan, and what carrying it out gave.

As vLLM's KV connector splits its work (the scheduler half builds a step's metadata; the worker half acts only on
it), :func:`plan_escalation` builds an :class:`EscalationPlan` from plain data (the two backends, the prompt, the
salt, the handoff's configuration) and one executor per engine kind (:mod:`agentkv.handoff.executors`: in-process
engines, vLLM servers, replay) carries it out and returns a :class:`HandoffOutcome`. Nothing here does I/O.

    plan = plan_escalation(fast, slow, payload, salt, backend="ridge", via="vllm", previous=last_served)
    plan.engine                  # "vllm": export plan.export on fast, then name it in the escalated request
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from agentkv.backends import Backend
from agentkv.handoff.protocol import DEFAULT_MIN_ATTENTION_COSINE, REPLAY
from agentkv.handoff.served import export_body
from agentkv.tokens import Payload

__all__ = ["EscalatedRequest", "EscalationPlan", "ExportRequest", "HandoffOutcome", "plan_escalation",
           "replay_plan"]

ENGINES = ("replay", "embedded", "vllm")
"""The engine kinds a plan names: which executor carries it out."""


@dataclass(frozen=True)
class ExportRequest:
    """The one-token request that asks fast's connector to export the conversation's prefix."""

    url: str = field(repr=False)  # may carry credentials (user:password@, ?api_key=): never in a repr
    body: Mapping[str, Any] = field(repr=False)  # the prompt and the tenant's salt: never in a repr
    headers: Mapping[str, str] | None = field(default=None, repr=False)  # the routing headers: where fast served
    timeout_s: float = 60.0


@dataclass(frozen=True)
class EscalationPlan:
    """What the KV handoff at one escalation will do, and on which engines.

    ``engine``: ``"replay"`` (nothing moves: ``reason`` says why, ``fallback`` when a mapper was configured),
    ``"embedded"`` (map the fast engine's cached prefix of ``prefix`` into the slow engine, both served in this
    process at ``fast_url`` and ``slow_url``) or ``"vllm"`` (ask fast to run ``export``, then name the export in the
    escalated request, whose kwargs are ``request``, under the mapper name ``mapper_name``).
    """

    engine: str
    backend: str
    reason: str = ""
    fallback: bool = False
    min_attention_cosine: float = DEFAULT_MIN_ATTENTION_COSINE
    fast_url: str | None = field(default=None, repr=False)  # URLs may carry credentials: never in a repr
    slow_url: str | None = field(default=None, repr=False)
    fast_label: str = ""
    prefix: Payload | None = field(default=None, repr=False)
    cache_salt: str | None = field(default=None, repr=False)  # a salt is a capability: never in a repr
    export: ExportRequest | None = None
    mapper_name: str | None = None
    request: Mapping[str, Any] = field(default_factory=dict, repr=False)
    raw: bool = False  # ``request`` is an OpenAI body as it goes on the wire (the transport, the gateway)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"EscalationPlan.engine must be one of {ENGINES}, not {self.engine!r}")


@dataclass(frozen=True)
class EscalatedRequest:
    """What the escalated request must carry to name fast's export: its new kwargs and cache salt, and the export
    id (the caller keeps it with the request and hands it to :meth:`~agentkv.handoff.Handoff.answered`)."""

    kwargs: Mapping[str, Any] = field(repr=False)
    cache_salt: str | None = field(repr=False)
    export: str


@dataclass(frozen=True)
class HandoffOutcome:
    """What happened at one escalation: tokens whose KV was mapped in, the backend, and why.

    ``pending``: the escalated request carries an import (``request``); slow's answer says how many tokens it loaded.
    """

    mapped_tokens: int
    backend: str
    reason: str
    fallback: bool = False
    pending: bool = False
    request: EscalatedRequest | None = None


def replay_plan(backend: str, reason: str, *, fallback: bool = False) -> EscalationPlan:
    """A plan that moves nothing: the slow engine prefills the tokens itself."""
    return EscalationPlan("replay", backend, reason, fallback)


def plan_escalation(fast: Backend, slow: Backend, payload: Payload, cache_salt: str | None, *, backend: str,
                    via: str = "engines", min_attention_cosine: float = DEFAULT_MIN_ATTENTION_COSINE,
                    previous: Payload | None = None, headers: Mapping[str, str] | None = None,
                    request: Mapping[str, Any] | None = None, raw: bool = False, mapper_name: str | None = None,
                    export_timeout_s: float = 60.0) -> EscalationPlan:
    """The handoff at the escalation of ``payload`` from ``fast`` to ``slow`` under ``cache_salt``.

    ``backend``: the configured mapper backend (``replay``: nothing to do); ``via``: ``"engines"`` (in-process) or
    ``"vllm"`` (AgentKVConnector). Over vLLM, ``previous`` (what fast last served, cheap to export: it is cached) is
    the prefix exported, ``headers`` go with the export (a router sends it where fast served the conversation),
    ``request`` and ``raw`` are the escalated request's kwargs, and ``mapper_name`` what slow's connector calls the
    mapper (default: fast's served model).
    """
    if backend == REPLAY:
        return replay_plan(backend, "replay configured")
    if via == "engines":
        return EscalationPlan("embedded", backend, min_attention_cosine=min_attention_cosine, fast_url=fast.api_base,
                              slow_url=slow.api_base, fast_label=fast.label, prefix=payload, cache_salt=cache_salt)
    prefix = previous or payload
    url = f"{(fast.api_base or '').rstrip('/')}/chat/completions"
    export = ExportRequest(url, export_body(fast.served_model, prefix, cache_salt), headers, export_timeout_s)
    return EscalationPlan("vllm", backend, min_attention_cosine=min_attention_cosine, fast_url=fast.api_base,
                          slow_url=slow.api_base, fast_label=fast.label, prefix=prefix, cache_salt=cache_salt,
                          export=export, mapper_name=mapper_name or fast.served_model, request=dict(request or {}),
                          raw=raw)
