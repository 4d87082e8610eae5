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
lives on that request's attempt (``Attempt.handoff_export``), so escalations in flight at once each count their
own: what slow reports having loaded is counted when that request's answer arrives (:meth:`Handoff.answered`):
``handoff_mapped``, ``mapped_tokens``, or a ``handoff_fallbacks`` when it loaded nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from agentkv._http import HttpTransport
from agentkv.backends import Backend
from agentkv.errors import ConfigurationError
from agentkv.events import emit
from agentkv.handoff.protocol import DEFAULT_MIN_ATTENTION_COSINE, REPLAY
from agentkv.stats import SessionStats
from agentkv.tokens import Payload

__all__ = ["Handoff", "HandoffOutcome", "warm_cold_reason"]


@dataclass(frozen=True)
class HandoffOutcome:
    """What happened at one escalation: tokens whose KV was mapped in, the backend, and why.

    ``pending``: the escalated request carries an import; slow's answer says how many tokens it loaded.
    """

    mapped_tokens: int
    backend: str
    reason: str
    fallback: bool = False
    pending: bool = False


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
        self._spec = mapper
        self._mapper: Any = None
        self.min_attention_cosine = DEFAULT_MIN_ATTENTION_COSINE if min_attention_cosine is None else min_attention_cosine
        self.via, self.mapper_name, self.export_timeout_s = via, mapper_name, export_timeout_s

    @property
    def active(self) -> bool:
        """False for ``replay``: nothing to do at escalation."""
        return self.backend != REPLAY

    def at_escalation(self, fast: Backend, slow: Backend, payload: Payload, cache_salt: str | None, *,
                      attempt: Any = None, previous: Payload | None = None, warm: Any = None,
                      http: HttpTransport | None = None, headers: Mapping[str, str] | None = None) -> HandoffOutcome:
        """Map the fast engine's cached prefix into the slow engine, or say why it replays instead.

        ``via="vllm"``: ``attempt`` (the escalated request, edited to name the export), ``previous`` (the payload
        fast last served), ``warm`` (the Session's warm-ahead), ``http`` (the seam the export goes through) and
        ``headers`` (the conversation's routing headers, so a router sends the export where fast served it).
        """
        if self.via == "vllm":
            if attempt is None or http is None:
                return self._fallback("a vLLM handoff needs the escalated request and an HTTP transport")
            return self._via_connector(fast, attempt, previous or payload, cache_salt, warm, http, headers)
        from agentkv.embedded.server import engine_at

        engines = engine_at(fast.api_base), engine_at(slow.api_base)
        if None in engines:
            return self._fallback("fast and slow are not both embedded engines in this process")
        try:
            return self._map(engines[0], engines[1], payload, cache_salt)
        except Exception as error:  # a handoff never fails the request: the slow engine prefills instead
            return self._fallback(f"{type(error).__name__}: {error}")

    def _map(self, source: Any, target: Any, payload: Payload, cache_salt: str | None) -> HandoffOutcome:
        from agentkv.handoff.engines import handoff_prefix
        from agentkv.handoff.plan import choose_handoff, log_plan
        from agentkv.handoff.engines import engine_signature

        plan = choose_handoff(self._load(source, target), self.min_attention_cosine,
                              source=engine_signature(source), target=engine_signature(target))
        log_plan(plan)
        if plan.replay:
            return HandoffOutcome(0, REPLAY, plan.reason, fallback=plan.fallback)
        token_ids = source.tokenize_chat(list(payload.messages or ()), list(payload.tools or ()) or None,
                                         payload.tool_choice, chat_template_kwargs=payload.template_kwargs)
        result = handoff_prefix(source, target, token_ids, plan.mapper, cache_salt=cache_salt)
        return HandoffOutcome(result.mapped_tokens, result.backend, result.reason, fallback=result.replayed)

    def _load(self, source: Any, target: Any) -> Any:
        if self._mapper is None:
            from agentkv.handoff.registry import load_mapper

            spec = self._spec if self._spec is not None else self.backend
            self._mapper = load_mapper(spec, source=source.model, target=target.model) \
                if isinstance(spec, (str, Path)) and Path(spec).is_dir() else spec
        return self._mapper

    def _via_connector(self, fast: Backend, attempt: Any, prefix: Payload, cache_salt: str | None, warm: Any,
                       http: HttpTransport, headers: Mapping[str, str] | None) -> HandoffOutcome:
        from agentkv.handoff.plan import choose_handoff, log_plan
        from agentkv.handoff.served import MapperSummary, import_request

        cold = warm_cold_reason(warm)
        if cold is None:
            emit("handoff.skipped", reason="slow holds the warmed prefix")
            return HandoffOutcome(0, REPLAY, "slow holds the warmed prefix")
        try:
            summary = MapperSummary.read(self._spec) if self._spec is not None else None
        except Exception as error:  # an unreadable mapper is a replay, never a failed request
            return self._fallback(f"{type(error).__name__}: {error}")
        plan = choose_handoff(summary if summary is not None else self.backend, self.min_attention_cosine)
        log_plan(plan, cold=cold)
        if plan.replay:
            return HandoffOutcome(0, REPLAY, plan.reason, fallback=plan.fallback)
        exported = self._export(fast, prefix, cache_salt, http, headers)
        if isinstance(exported, HandoffOutcome):
            return exported
        attempt.kwargs, attempt.cache_salt = import_request(attempt.kwargs, exported, summary, cache_salt,
                                                            mapper_name=self.mapper_name or fast.served_model,
                                                            raw=attempt.raw)
        attempt.handoff_export = exported  # per request: two escalations in flight each count their own import
        return HandoffOutcome(0, plan.backend, f"import of {exported[:12]} sent ({cold})", pending=True)

    def _export(self, fast: Backend, prefix: Payload, cache_salt: str | None, http: HttpTransport,
                headers: Mapping[str, str] | None = None) -> str | HandoffOutcome:
        """Ask fast to export ``prefix``'s KV: the export id, or the fallback outcome when it did not."""
        from agentkv.handoff.served import export_body
        from agentkv.wire.kv_transfer import export_result

        started = time.perf_counter()
        url = f"{(fast.api_base or '').rstrip('/')}/chat/completions"
        try:
            answer = http.post_json(url, export_body(fast.served_model, prefix, cache_salt),
                                    timeout_s=self.export_timeout_s, headers=headers)
        except Exception as error:  # fast unreachable or refusing: replay
            return self._fallback(f"export failed: {type(error).__name__}: {str(error)[:200]}")
        found = export_result(answer.get("kv_transfer_params") if isinstance(answer, dict) else None)
        if found is None:
            return self._fallback("fast exported nothing (no AgentKVConnector there?)")
        emit("handoff.export", backend=fast.label, export=found[0][:12], tokens=found[1],
             export_ms=round((time.perf_counter() - started) * 1e3, 3))
        return found[0]

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

    def _fallback(self, reason: str) -> HandoffOutcome:
        emit("handoff.fallback", level="warning", backend=REPLAY, configured=self.backend, reason=reason)
        return HandoffOutcome(0, REPLAY, reason, fallback=True)


def warm_cold_reason(warm: Any) -> str | None:
    """Why slow would prefill this escalation cold (see :func:`~agentkv.handoff.served.cold_reason`), asking the
    ledger (through slow's tokenizer) when one follows slow; None when the warmed prefix is held."""
    from agentkv.handoff.served import cold_reason

    warmed = getattr(warm, "warmed", None)
    residency = getattr(warm, "residency", None)
    held = tokens = size = None
    if warmed is not None and residency is not None:
        try:
            ids, exact = residency.counter.token_ids(warmed, add_generation_prompt=False)
            size = residency.ledger.block_size(residency.backend)
            if exact and residency.ledger.live(residency.backend) and size:
                held, tokens = residency.held(ids), len(ids)
        except Exception as exc:  # the ledger cannot tell: trust the warm
            emit("handoff.residency_unknown", level="debug", error=type(exc).__name__)
    return cold_reason(warmed=warmed is not None, held_tokens=held, warmed_tokens=tokens, block_size=size)
