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
switch); the tenant appears only as a digest, keyed by the cache-salt secret when one is set.
``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` drops the older ``gen_ai.system`` beside
``gen_ai.provider.name``.

Telemetry never fails a turn: every place agentkv starts, annotates, links or ends a span, or records a metric, is
guarded. A sampler, processor, exporter or meter that raises loses that span or point, never the turn; the loss is
counted by error type (:func:`failures`) and reported once per type as a ``telemetry_failed`` event (the type only,
never the error's text). An SDK's ``SimpleSpanProcessor`` exports on the request path by design: use
``BatchSpanProcessor``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, ParamSpec, TypeVar

from agentkv.events import emit

__all__ = ["Instruments", "active", "added", "annotated", "atraced", "capture_content", "ended", "event", "failures",
           "guarded", "instruments", "latest_conventions", "link_to", "lost", "messages_attribute", "provider_attributes",
           "recorded", "span_in", "tenant_digest", "traced", "tracer", "use"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

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
    with _lost_lock:
        _lost.clear()


_lost_lock = threading.Lock()
_lost: dict[str, int] = {}  # error type -> spans, span updates and metric points lost since use() last set providers
_MAX_LOST_TYPES = 32  # bounded: a sampler raising ever-new exception classes cannot grow it


def failures() -> dict[str, int]:
    """Spans, span updates and metric points lost to a raising sampler, processor, exporter or meter, by error type
    (since :func:`use` last set providers; the global providers' losses since the process started)."""
    with _lost_lock:
        return dict(_lost)


def lost(error: BaseException) -> None:
    """Count a telemetry failure by its type; the first of each type is a ``telemetry_failed`` event (never the
    error's text: a processor's message may quote what it was handed)."""
    name = type(error).__name__
    with _lost_lock:
        if name not in _lost and len(_lost) >= _MAX_LOST_TYPES:
            name = "other"
        first = name not in _lost
        _lost[name] = _lost.get(name, 0) + 1
    if first:
        emit("telemetry_failed", level="warning", error=name)


def guarded(fallback: T) -> Callable[[Callable[P, R]], Callable[P, R | T]]:
    """``fn`` with whatever it raises (an ``Exception``) counted by :func:`lost` and ``fallback`` returned instead:
    for every call that touches an OpenTelemetry SDK, whose samplers, processors and meters are the application's."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R | T]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R | T:
            try:
                return fn(*args, **kwargs)
            except Exception as error:  # telemetry is never worth a turn: counted, reported once, dropped
                lost(error)
                return fallback

        return run

    return wrap


_apis: dict[str, Any] = {}  # "trace", "metrics": the API modules (None: not installed), imported on first use
# Per API: its provider's name (use()'s keyword, ``get_{name}`` the API's getter of the global one), and the classes
# of the providers that record nothing (the proxy in place until an SDK sets one, and the no-op one).
_PROVIDERS = {"trace": ("tracer_provider", {"ProxyTracerProvider", "NoOpTracerProvider"}),
              "metrics": ("meter_provider", {"_ProxyMeterProvider", "NoOpMeterProvider"})}


def _api(name: str) -> Any:
    """The OpenTelemetry API module ``opentelemetry.{name}``, None when the API is not installed (an extra: no
    OpenTelemetry, no spans)."""
    try:
        return _apis[name]
    except KeyError:
        try:
            module: Any = importlib.import_module(f"opentelemetry.{name}")
        except ImportError:
            module = None
        _apis[name] = module
        return module


def _trace_api() -> Any:
    return _api("trace")


def _provider(name: str) -> Any | None:
    """The provider in force for the API ``name`` ("trace", "metrics"): the one :func:`use` was given, else the
    global one when it records anything (None: no API, or only its proxy or no-op provider)."""
    kind, silent = _PROVIDERS[name]
    provider = _override.get(kind)
    if provider is not None:
        return provider
    api = _api(name)
    if api is None:
        return None
    provider = getattr(api, f"get_{kind}")()
    return None if any(cls.__name__ in silent for cls in type(provider).__mro__) else provider


def _cached(key: str, make: Callable[[], T]) -> T:
    """What ``make`` returns, made once per ``key`` (a provider's id) until :func:`use` sets providers."""
    found = _cache.get(key)
    if found is None:
        with _lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = make()
    return found


@guarded(None)
def tracer() -> Any | None:
    """agentkv's tracer when an SDK is configured, else None (the caller then does nothing)."""
    provider = _provider("trace")
    if provider is None:
        return None
    return _cached(f"tracer-{id(provider)}", lambda: provider.get_tracer(_SCOPE, _version()))


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


@guarded(None)
def instruments() -> Instruments | None:
    """agentkv's instruments when a meter provider with an SDK is configured, else None."""
    provider = _provider("metrics")
    if provider is None:
        return None
    return _cached(f"meter-{id(provider)}", lambda: _made(provider.get_meter(_SCOPE)))


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


def tenant_digest(tenant: str | None, secret: str | bytes | None = None) -> str | None:
    """What spans carry for a tenant (never its name): 16 hex digits of an HMAC-SHA256 keyed by ``secret`` (the
    Session's cache-salt secret), so that a dictionary of likely names recovers nothing; the first 16 hex digits of
    its plain SHA-256 only when no secret is set."""
    if tenant is None:
        return None
    name = tenant.encode("utf-8", "surrogatepass")
    if not secret:
        return hashlib.sha256(name).hexdigest()[:16]
    key = secret.encode("utf-8", "surrogatepass") if isinstance(secret, str) else secret
    return hmac.new(key, b"agentkv-tenant-v1\0" + name, hashlib.sha256).hexdigest()[:16]


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


@guarded(None)
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


@guarded(None)
def ended(span: Any, *, error: BaseException | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """End ``span`` (None: nothing) with ``attributes`` set, and ``error``'s type as ``error.type`` and an error
    status (never its message: a server's error text can hold the prompt). It ends even when setting them fails."""
    if span is None:
        return
    try:
        for key, value in (attributes or {}).items():
            if value is not None:
                span.set_attribute(key, value)
        if error is not None:
            api = _trace_api()
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(api.Status(api.StatusCode.ERROR))
    finally:
        span.end()


@guarded(None)
def annotated(span: Any, attributes: Mapping[str, Any]) -> None:
    """``attributes`` set on ``span`` (None: nothing), the None-valued ones left out."""
    if span is not None:
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)


@guarded(None)
def event(span: Any, name: str, attributes: Mapping[str, Any]) -> None:
    """An event ``name`` on ``span`` (None: nothing)."""
    if span is not None:
        span.add_event(name, dict(attributes))


@guarded(None)
def added(counter: Any, value: int, attributes: Mapping[str, Any]) -> None:
    """``value`` added to ``counter``."""
    counter.add(value, dict(attributes))


@guarded(None)
def recorded(histogram: Any, value: float, attributes: Mapping[str, Any]) -> None:
    """``value`` recorded in ``histogram``."""
    histogram.record(value, dict(attributes))


@guarded([])
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
        if span is None:  # nothing records, or the SDK failed to start it: the send goes on untraced
            return send()
        try:
            with _current(span):  # what the client instruments nests under the warm
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
        if span is None:
            return await send()
        try:
            with _current(span):
                result = await send()
        except BaseException as error:
            ended(span, error=error)
            raise
        ended(span)
        return result

    return run


def _current(span: Any) -> Any:
    """``span`` made current for what runs inside (not ended on exit). An error raised inside is neither recorded
    nor set as its status here: :func:`ended` records its type, never its text."""
    return _trace_api().use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)
