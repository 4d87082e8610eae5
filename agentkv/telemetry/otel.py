"""OpenTelemetry spans and metrics for what a Session decides, through ``opentelemetry-api`` only.

Nothing here runs unless the application configured an OpenTelemetry SDK (a real tracer or meter provider, set
globally or handed to :func:`use`): with the API absent, or its default no-op providers in place, every entry point
returns at once. ``opentelemetry`` is imported on the first request, never at ``import agentkv``.

Spans follow the OpenTelemetry GenAI semantic conventions (Development status):

- one span per turn, ``chat {model}`` (``text_completion`` for a prompt), from routing to the answer's usage, with
  agentkv's decisions under ``agentkv.*``; an escalation's span links to the warm that prepared it;
- one child per try (a retry, a clamp, an escalation after an overflow, a failover each add one);
- one span per warm, ``agentkv.warm {model}``, a child of the turn that fired it (in its thread or task);
- one per KV handoff and one per count-source call that went over the network.

No prompt text is recorded unless ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` is ``true`` (the conventions'
switch); the tenant appears only as a digest. ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` drops the
older ``gen_ai.system`` beside ``gen_ai.provider.name``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Instruments", "active", "atraced", "capture_content", "ended", "instruments", "latest_conventions",
           "link_to", "messages_attribute", "provider_attributes", "span_in", "tenant_digest", "traced", "tracer", "use"]

_SCOPE = "agentkv"
_lock = threading.Lock()
_override: dict[str, Any] = {}  # "tracer_provider", "meter_provider": what use() was given
_cache: dict[str, Any] = {}  # the tracer and instruments of the providers in force, keyed by their ids


def use(*, tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Send agentkv's spans and metrics to these providers instead of the global ones (None: the global again).
    For applications that keep providers of their own, and for tests with in-memory exporters."""
    with _lock:
        _override.clear()
        if tracer_provider is not None:
            _override["tracer_provider"] = tracer_provider
        if meter_provider is not None:
            _override["meter_provider"] = meter_provider
        _cache.clear()


_apis: dict[str, Any] = {}  # "trace", "metrics": the API modules (None: not installed), imported on first use


def _trace_api() -> Any:
    try:
        return _apis["trace"]
    except KeyError:
        try:
            from opentelemetry import trace
        except ImportError:  # the API is an extra: no OpenTelemetry, no spans
            trace = None  # type: ignore[assignment]
        _apis["trace"] = trace
        return trace


def _metrics_api() -> Any:
    try:
        return _apis["metrics"]
    except KeyError:
        try:
            from opentelemetry import metrics
        except ImportError:
            metrics = None  # type: ignore[assignment]
        _apis["metrics"] = metrics
        return metrics


def _real(provider: Any, api: Any) -> bool:
    """Whether ``provider`` records anything (not the API's proxy or no-op provider)."""
    return not isinstance(provider, (api.ProxyTracerProvider, api.NoOpTracerProvider))


def tracer() -> Any | None:
    """agentkv's tracer when an SDK is configured, else None (the caller then does nothing)."""
    provider = _override.get("tracer_provider")
    if provider is None:
        api = _trace_api()
        if api is None:
            return None
        provider = api.get_tracer_provider()
        if not _real(provider, api):
            return None
    key = f"tracer-{id(provider)}"
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = provider.get_tracer(_SCOPE, _version())
    return found


def _version() -> str | None:
    """The installed agentkv's version, for the instrumentation scope (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentkv")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return None


@dataclass(frozen=True)
class Instruments:
    """The metrics agentkv records: the GenAI conventions' two histograms and its own counters."""

    token_usage: Any
    duration: Any
    routes: Any
    warms: Any
    escalations: Any
    failovers: Any
    overflows: Any


def instruments() -> Instruments | None:
    """agentkv's instruments when a meter provider with an SDK is configured, else None."""
    provider = _override.get("meter_provider")
    if provider is None:
        metrics = _metrics_api()
        if metrics is None:
            return None
        provider = metrics.get_meter_provider()
        if isinstance(provider, metrics.NoOpMeterProvider) or type(provider).__name__ == "_ProxyMeterProvider":
            return None
    key = f"meter-{id(provider)}"
    found = _cache.get(key)
    if found is None:
        with _lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = _made(provider.get_meter(_SCOPE))
    return found


def _made(meter: Any) -> Instruments:
    return Instruments(
        token_usage=meter.create_histogram("gen_ai.client.token.usage", unit="{token}",
                                           description="Input and output tokens per request, as the server counted"),
        duration=meter.create_histogram("gen_ai.client.operation.duration", unit="s",
                                        description="A turn's time, from routing to its answer"),
        routes=meter.create_counter("agentkv.routes", unit="{request}", description="Turns routed, by role and reason"),
        warms=meter.create_counter("agentkv.warms", unit="{warm}", description="Warm-ahead decisions, by outcome"),
        escalations=meter.create_counter("agentkv.escalations", unit="{escalation}",
                                         description="Escalations to slow, by whether a warm was found cached"),
        failovers=meter.create_counter("agentkv.failovers", unit="{failover}",
                                       description="Turns moved off a backend or replica found down"),
        overflows=meter.create_counter("agentkv.overflows_recovered", unit="{overflow}",
                                       description="Context overflows recovered (clamped or escalated)"),
    )


def active() -> bool:
    """Whether spans or metrics are recorded at all (cheap: for callers that would build attributes)."""
    return tracer() is not None or instruments() is not None


def capture_content() -> bool:
    """The conventions' opt-in to message content (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``)."""
    return os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() in ("true", "1")


def latest_conventions() -> bool:
    """``OTEL_SEMCONV_STABILITY_OPT_IN`` names ``gen_ai_latest_experimental``: no deprecated attribute names."""
    return "gen_ai_latest_experimental" in os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "")


def tenant_digest(tenant: str | None) -> str | None:
    """What spans carry for a tenant: the first 16 hex digits of its SHA-256 (never its name)."""
    return None if tenant is None else hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def provider_attributes(model: str) -> dict[str, str]:
    """``gen_ai.provider.name`` from a litellm model string (``hosted_vllm/x`` -> ``vllm``), and the older
    ``gen_ai.system`` unless the latest conventions are opted into."""
    prefix = model.split("/", 1)[0] if "/" in model else "openai"
    name = {"hosted_vllm": "vllm", "gemini": "gcp.gemini", "vertex_ai": "gcp.vertex_ai", "bedrock": "aws.bedrock",
            "azure": "azure.ai.openai"}.get(prefix, prefix)
    return {"gen_ai.provider.name": name} if latest_conventions() else {"gen_ai.provider.name": name,
                                                                       "gen_ai.system": name}


def messages_attribute(messages: Any) -> dict[str, str]:
    """``gen_ai.input.messages`` when content capture is on (else nothing), bounded to 64 KiB of JSON."""
    if not capture_content() or messages is None:
        return {}
    try:
        text = json.dumps(messages, default=str)
    except (TypeError, ValueError):
        return {}
    return {"gen_ai.input.messages": text[: 64 << 10]}


def span_in(parent: Any, name: str, attributes: Mapping[str, Any], *, kind: str = "INTERNAL",
            links: Any = ()) -> Any | None:
    """A started span, a child of ``parent`` (a span; None: the current context), or None when nothing records."""
    found = tracer()
    if found is None:
        return None
    api = _trace_api()
    context = api.set_span_in_context(parent) if parent is not None else None
    return found.start_span(name, context=context, kind=getattr(api.SpanKind, kind),
                            attributes={k: v for k, v in attributes.items() if v is not None}, links=list(links))


def ended(span: Any, *, error: BaseException | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """End ``span`` (None: nothing) with ``attributes`` set, and ``error``'s type as ``error.type`` and an error
    status (never its message: a server's error text can hold the prompt)."""
    if span is None:
        return
    for key, value in (attributes or {}).items():
        if value is not None:
            span.set_attribute(key, value)
    if error is not None:
        api = _trace_api()
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(api.Status(api.StatusCode.ERROR))
    span.end()


def link_to(span: Any) -> list[Any]:
    """A link to ``span`` (None: none), for a span that follows from it."""
    if span is None:
        return []
    api = _trace_api()
    return [api.Link(span.get_span_context())]


def now() -> float:
    return time.perf_counter()


def traced(send: Callable[[], Any], parent: Any, name: str, attributes: Mapping[str, Any],
           on_start: Callable[[Any], None] | None = None) -> Callable[[], Any]:
    """``send`` run inside a span ``name`` (a child of ``parent``), ended when it returns or raises; ``send`` itself
    when nothing records. ``on_start`` is handed the span when it starts (a warm keeps it for the escalation's link)."""
    if tracer() is None:
        return send

    def run() -> Any:
        span = span_in(parent, name, attributes, kind="CLIENT")
        if on_start is not None:
            on_start(span)
        api = _trace_api()
        try:
            with api.use_span(span, end_on_exit=False):  # what the client instruments nests under the warm
                result = send()
        except BaseException as error:
            ended(span, error=error)
            raise
        ended(span)
        return result

    return run


def atraced(send: Callable[[], Any], parent: Any, name: str, attributes: Mapping[str, Any],
            on_start: Callable[[Any], None] | None = None) -> Callable[[], Any]:
    """The async twin of :func:`traced`: ``send`` returns an awaitable."""
    if tracer() is None:
        return send

    async def run() -> Any:
        span = span_in(parent, name, attributes, kind="CLIENT")
        if on_start is not None:
            on_start(span)
        api = _trace_api()
        try:
            with api.use_span(span, end_on_exit=False):
                result = await send()
        except BaseException as error:
            ended(span, error=error)
            raise
        ended(span)
        return result

    return run
