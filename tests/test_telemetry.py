"""OpenTelemetry spans and metrics from the library, read back through the SDK's in-memory exporters: a conversation
that crosses 60%, escalates onto its warm and fails over, sync and async; no prompt text unless asked for."""

import json

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

import agentkv.telemetry  # noqa: E402
from agentkv import Backend, Session, WindowDiscovery  # noqa: E402
from agentkv.demo.script import TOOLS, ScriptedAgent  # noqa: E402
from agentkv.state import InProcessStore  # noqa: E402

TOOLS8 = TOOLS[:8]


@pytest.fixture
def otel():
    """agentkv's spans and metrics into in-memory exporters for one test."""
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    agentkv.telemetry.use(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        yield spans, reader
    finally:
        agentkv.telemetry.use()


def grow(turns):
    return ScriptedAgent(result_rows=1).conversation(turns)


def session(fresh, **kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, session_id=fresh["session_id"], discovery=fresh["discovery"], state=InProcessStore(
        cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"]), **kwargs)


def metric_points(reader):
    """{metric name: [(attributes, value)]} of everything recorded (counters' sums, histograms' counts and sums)."""
    found = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    if value is None:
                        value = (point.count, point.sum)
                    found.setdefault(metric.name, []).append((dict(point.attributes), value))
    return found


def check_conversation(spans, s, history):
    """The documented span tree: one turn span per turn with its tries beneath, the warm under the turn that fired
    it, the escalation linked to the warm and carrying the server's cached tokens."""
    finished = spans.get_finished_spans()
    turns = [sp for sp in finished if sp.attributes.get("agentkv.route.role") and sp.parent is None]
    assert len(turns) == len(s.ledger)
    for span, row in zip(sorted(turns, key=lambda sp: sp.start_time), s.ledger):
        assert span.kind is SpanKind.CLIENT and span.name.startswith("chat ")
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.provider.name"] == "vllm"
        assert span.attributes["agentkv.route.role"] == row.backend and span.attributes["agentkv.route.reason"] == row.reason
        assert span.attributes["agentkv.tokens.estimated"] == row.input_tokens
        assert span.attributes["gen_ai.usage.input_tokens"] > 0 and "agentkv.window" in span.attributes
        tries = [sp for sp in finished if sp.parent is not None and sp.parent.span_id == span.context.span_id
                 and sp.name.startswith("chat ")]
        assert tries, span.name
    warm = next(sp for sp in finished if sp.name.startswith("agentkv.warm "))
    fired = next(sp for sp in turns if sp.attributes.get("agentkv.warm.outcome") == "fire")
    assert warm.parent.span_id == fired.context.span_id and warm.attributes["gen_ai.request.max_tokens"] == 1
    escalation = next(sp for sp in turns if sp.attributes["agentkv.route.escalation"])
    assert [link.context.span_id for link in escalation.links] == [warm.context.span_id]
    escalated = next(row for row in s.ledger if row.backend == "slow")
    assert escalation.attributes["gen_ai.usage.cache_read.input_tokens"] == escalated.cached_tokens > 0
    text = json.dumps([dict(sp.attributes) for sp in finished] + [dict(e.attributes) for sp in finished
                                                                    for e in sp.events])
    for message in history[-1]:
        content = message.get("content")
        if isinstance(content, str) and len(content) > 20:
            assert content[:40] not in text  # no prompt text anywhere


def run_to_slow(s, history):
    for msgs in history:
        s.completion(messages=msgs, tools=TOOLS8, max_tokens=2)
        s.drain_warms(30)
        if s.last_route.role == "slow":
            return msgs
    raise AssertionError("never escalated")


def test_a_conversation_that_warms_and_escalates_yields_the_documented_spans_and_metrics(fresh, otel):
    """Turn spans with tries beneath them, the warm under its turn, the escalation linked to the warm with the
    server's cached tokens; the GenAI histograms and agentkv's counters count the same turns."""
    spans, reader = otel
    history = grow(12)
    with session(fresh, tenant="acme", cache_salt_secret="k") as s:
        run_to_slow(s, history)
    check_conversation(spans, s, history)
    assert all(sp.attributes.get("agentkv.tenant") in (None, agentkv.telemetry.tenant_digest("acme", "k"))
               for sp in spans.get_finished_spans())
    points = metric_points(reader)
    routes = sum(value for attrs, value in points["agentkv.routes"])
    assert routes == len(s.ledger)
    assert [value for attrs, value in points["agentkv.warms"] if attrs["agentkv.warm.outcome"] == "fire"] == [1]
    assert points["agentkv.escalations"] == [({"agentkv.escalation.found_warm": True}, 1)]
    inputs = [value for attrs, value in points["gen_ai.client.token.usage"] if attrs["gen_ai.token.type"] == "input"]
    assert sum(count for count, _ in inputs) == len(s.ledger)
    assert sum(count for _, (count, _) in points["gen_ai.client.operation.duration"]) == len(s.ledger)


async def test_the_async_path_yields_the_same_tree(fresh, otel):
    """acompletion: the same spans, the warm (a task) under its turn, the escalation linked to it."""
    spans, _ = otel
    history = grow(12)
    async with session(fresh, tenant="acme", cache_salt_secret="k") as s:
        for msgs in history:
            await s.acompletion(messages=msgs, tools=TOOLS8, max_tokens=2)
            await s.adrain_warms(30)
            if s.last_route.role == "slow":
                break
    check_conversation(spans, s, history)


def test_a_failover_is_an_event_on_the_turn_and_its_failed_try_a_span_with_the_error_type(fresh, otel):
    """fast down: the turn's span carries an agentkv.failover event, the failed try ends in error (its type, never its
    text), the try that answered beneath the same turn, and the failover is counted."""
    spans, reader = otel
    dead = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base="http://127.0.0.1:9/v1", name="fast", window=2048)
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    from agentkv import RetryPolicy

    with Session(dead, slow, discovery=WindowDiscovery(), retry=RetryPolicy(sleep=lambda s: None),
                 state=InProcessStore()) as s:
        s.completion(messages=[{"role": "user", "content": "hello there"}], max_tokens=2)
    finished = spans.get_finished_spans()
    turn = next(sp for sp in finished if sp.parent is None and sp.attributes.get("agentkv.route.role"))
    assert [e.name for e in turn.events] == ["agentkv.failover"]
    assert turn.events[0].attributes["agentkv.failover.kind"] == "backend"
    tries = [sp for sp in finished if sp.parent is not None and sp.parent.span_id == turn.context.span_id]
    failed = [sp for sp in tries if sp.status.status_code is StatusCode.ERROR]
    assert failed and all(sp.attributes["error.type"] for sp in failed) and not any(sp.status.description
                                                                                    for sp in failed)
    assert tries[-1].attributes["gen_ai.request.model"] == fresh["slow"].model_id
    assert metric_points(reader)["agentkv.failovers"] == [({"agentkv.failover.kind": "backend"}, 1)]


async def test_an_async_failover_is_recorded_alike(fresh, otel):
    """acompletion over a fast server that is down: the same failover event, error-typed try and counter."""
    spans, reader = otel
    dead = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base="http://127.0.0.1:9/v1", name="fast", window=2048)
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    from agentkv import RetryPolicy

    async def no_sleep(seconds):
        return None

    async with Session(dead, slow, discovery=WindowDiscovery(), retry=RetryPolicy(asleep=no_sleep),
                       state=InProcessStore()) as s:
        await s.acompletion(messages=[{"role": "user", "content": "hello there"}], max_tokens=2)
    finished = spans.get_finished_spans()
    turn = next(sp for sp in finished if sp.parent is None and sp.attributes.get("agentkv.route.role"))
    assert [e.name for e in turn.events] == ["agentkv.failover"]
    tries = [sp for sp in finished if sp.parent is not None and sp.parent.span_id == turn.context.span_id]
    assert any(sp.status.status_code is StatusCode.ERROR for sp in tries)
    assert tries[-1].status.status_code is not StatusCode.ERROR
    assert metric_points(reader)["agentkv.failovers"] == [({"agentkv.failover.kind": "backend"}, 1)]


def test_message_content_is_recorded_only_when_the_conventions_switch_is_on(fresh, otel, monkeypatch):
    """OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true puts the messages on the turn's span; off, nothing."""
    spans, _ = otel
    messages = [{"role": "user", "content": "a message only the capture switch may record"}]
    with session(fresh) as s:
        s.completion(messages=messages, max_tokens=2)
        monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
        s.completion(messages=messages, max_tokens=2)
    first, second = sorted((sp for sp in spans.get_finished_spans() if sp.parent is None
                            and sp.attributes.get("agentkv.route.role")), key=lambda sp: sp.start_time)
    assert "gen_ai.input.messages" not in first.attributes
    assert json.loads(second.attributes["gen_ai.input.messages"]) == messages


def test_without_an_sdk_nothing_is_recorded_and_opentelemetry_is_not_imported_by_agentkv():
    """No provider configured: the tracer is None (every hook returns at once), and ``import agentkv`` imports no
    OpenTelemetry module."""
    import subprocess
    import sys

    from agentkv.telemetry import otel

    agentkv.telemetry.use()
    assert otel.tracer() is None and otel.instruments() is None
    code = "import sys, agentkv; from agentkv import Session; print(any(m.startswith('opentelemetry') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "False"


def check_framework_tree(spans, app):
    """Every turn is a child of the application's span; the warm is a child of the turn that fired it; the
    escalation links to the warm."""
    finished = spans.get_finished_spans()
    turns = [sp for sp in finished if sp.attributes.get("agentkv.route.role") and sp.name.startswith("chat ")
             and sp.parent is not None and sp.parent.span_id == app.context.span_id]
    assert turns and all(sp.context.trace_id == app.context.trace_id for sp in turns)
    warm = next(sp for sp in finished if sp.name.startswith("agentkv.warm "))
    assert warm.parent.span_id in {sp.context.span_id for sp in turns}
    escalation = next(sp for sp in turns if sp.attributes.get("agentkv.route.escalation"))
    assert [link.context.span_id for link in escalation.links] == [warm.context.span_id]


def langgraph_run(fresh, s):
    import httpx
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    from agentkv.integrations.openai import AgentKVTransport
    from agentkv.testing import ScriptedTransport

    @tool
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return f"results for {topic}:\n" + "host sdb latency p99 40 ms, queue depth 3, backlog 9 GiB\n" * 6

    steps = [[("lookup", json.dumps({"topic": f"disk-{i}"}))] for i in range(14)] + ["It was compaction."]
    transport = AgentKVTransport(s, inner=ScriptedTransport(steps))
    model = ChatOpenAI(model=fresh["fast"].model_id, base_url=fresh["fast"].api_base, api_key="-", max_tokens=8,
                       max_retries=0, http_client=httpx.Client(transport=transport))
    return create_react_agent(model, [lookup]).invoke({"messages": [("user", "Why the latency?")]},
                                                      {"recursion_limit": 100})


def test_under_langgraph_the_turns_join_the_applications_trace(fresh, otel):
    """A LangGraph agent over ChatOpenAI and the transport, inside the application's own span: every turn is its child
    (LangGraph runs nodes on its own threads), the warm sits under its turn, the escalation links to the warm."""
    spans, _ = otel
    tracer = agentkv.telemetry.otel.tracer()
    with session(fresh) as s, tracer.start_as_current_span("agent run") as app:
        result = langgraph_run(fresh, s)
        assert s.drain_warms(30)
    assert result["messages"][-1].content == "It was compaction."
    check_framework_tree(spans, app)


async def test_under_the_agents_sdk_the_turns_join_the_applications_trace(fresh, otel):
    """The OpenAI Agents SDK over the async transport, inside the application's span: the same tree (the warm a task
    of its own)."""
    import httpx
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    from agentkv.integrations.openai import AsyncAgentKVTransport
    from agentkv.testing import ScriptedTransport

    set_tracing_disabled(True)
    spans, _ = otel

    @function_tool
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return f"results for {topic}:\n" + "host sdb latency p99 40 ms, queue depth 3, backlog 9 GiB\n" * 6

    steps = [[("lookup", json.dumps({"topic": f"disk-{i}"}))] for i in range(14)] + ["It was compaction."]
    tracer = agentkv.telemetry.otel.tracer()
    async with session(fresh) as s:
        transport = AsyncAgentKVTransport(s, inner=ScriptedTransport(steps))
        client = AsyncOpenAI(base_url=fresh["fast"].api_base, api_key="-", max_retries=0,
                             http_client=httpx.AsyncClient(transport=transport))
        agent = Agent(name="sre", instructions="Investigate.", tools=[lookup], model_settings=ModelSettings(max_tokens=8),
                      model=OpenAIChatCompletionsModel(model=fresh["fast"].model_id, openai_client=client))
        with tracer.start_as_current_span("agent run") as app:
            result = await Runner.run(agent, "Why the latency?", max_turns=16)
        await s.adrain_warms(30)
    assert result.final_output == "It was compaction."
    check_framework_tree(spans, app)
