"""OpenTelemetry spans and metrics for a Session's decisions: whether a warm fired, whether the escalation found it
warm, what routing decided and why. Through ``opentelemetry-api`` only, and a no-op unless the application configured
an SDK; nothing is imported at ``import agentkv``.

- :mod:`agentkv.telemetry.otel`: the tracer and instruments (``use`` hands agentkv providers of its own), the
  conventions' switches (content capture, ``OTEL_SEMCONV_STABILITY_OPT_IN``), spans started and ended;
- :mod:`agentkv.telemetry.turns`: a turn's spans and metrics from the Session's own data.

A sampler, processor, exporter or meter that raises loses its span or point, never the turn (``failures`` counts
them by error type).

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    trace.set_tracer_provider(TracerProvider())      # agentkv's spans now go where the application's go

See ``docs/observability.md``.
"""

from agentkv.telemetry.otel import active, capture_content, failures, tenant_digest, use

__all__ = ["active", "capture_content", "failures", "tenant_digest", "use"]
