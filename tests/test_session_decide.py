"""One decision for every entry point: the pure next step of a turn, and what it makes the five drivers agree on."""

import asyncio
import json

import httpx
import pytest

from agentkv import Backend, RetryPolicy, Session, WindowDiscovery
from agentkv._session.decide import (
    Answered, Failed, FailOver, Finish, GiveUp, HandOff, Recover, Send, next_action,
)
from agentkv.http import HttpError
from agentkv.routing import RouteDecision
from agentkv.testing import FakeHttp, capture_events, models_answer
from agentkv.wire.kv_transfer import KEY

FAST, SLOW = "http://127.0.0.1:9301/v1", "http://127.0.0.1:9302/v1"
LONG = [{"role": "user", "content": "word " * 1000}]  # about 1,000 tokens: fits fast (2,048) and slow (16,384)


def decision(role="fast", reason="fits"):
    return RouteDecision(backend=role, role=role, reason=reason, estimated_input_tokens=10, window=2048,
                         max_tokens=8, count_source="tiktoken")


class Down(ConnectionRefusedError):
    """A refused connection, as the clients' innermost cause says it."""


class Overflow400(Exception):
    status_code = 400


def step(outcome, **overrides):
    inputs = dict(handed_off=False, handoff_active=False, previous_role=None, has_slow=True, retry=RetryPolicy(),
                  streamed=False)
    inputs.update(overrides)
    return next_action(decision(), outcome, **inputs)


def test_the_first_step_is_a_send_or_the_escalations_handoff_once():
    """Before a try: Send, or HandOff first when the try is the escalation and a mapper is configured (once)."""
    assert step(None) == Send()
    escalation = decision("slow", "proactive")
    assert next_action(escalation, None, handed_off=False, handoff_active=True, previous_role="fast", has_slow=True,
                       retry=RetryPolicy(), streamed=False) == HandOff()
    assert next_action(escalation, None, handed_off=True, handoff_active=True, previous_role="fast", has_slow=True,
                       retry=RetryPolicy(), streamed=False) == Send()
    assert next_action(escalation, None, handed_off=False, handoff_active=True, previous_role="slow", has_slow=True,
                       retry=RetryPolicy(), streamed=False) == Send()


def test_an_answer_finishes_an_overflow_recovers_an_outage_fails_over_and_anything_else_gives_up():
    """The outcome of a try decides the next step: the answer, a clamp or escalation, a failover, or the error."""
    assert step(Answered("ok")) == Finish("ok")
    overflow = Overflow400("This model's maximum context length is 2048 tokens. However, you requested 4000 tokens "
                           "(3000 in the messages, 1000 in the completion).")
    action = step(Failed(overflow))
    assert isinstance(action, Recover) and action.overflow.max_context == 2048
    down = Down("refused")
    assert step(Failed(down)) == FailOver(down)
    assert step(Failed(down), has_slow=False) == GiveUp(down)
    other = ValueError("bad")
    assert step(Failed(other)) == GiveUp(other)


def test_a_read_timeout_fails_over_only_where_the_policy_says_and_never_for_a_stream():
    """``RetryPolicy(timeout_fails_over=True)`` makes a read timeout an outage, except on a streamed request."""
    timeout = httpx.ReadTimeout("slow")
    assert step(Failed(timeout)) == GiveUp(timeout)
    assert step(Failed(timeout), retry=RetryPolicy(timeout_fails_over=True)) == FailOver(timeout)
    assert step(Failed(timeout), retry=RetryPolicy(timeout_fails_over=True), streamed=True) == GiveUp(timeout)


# ----------------------------------------------------------------------------- the five drivers agree

def _session(discovery, http, **kwargs):
    fast = Backend("hosted_vllm/fast-m", api_base=FAST, name="fast", window=2048)
    slow = Backend("hosted_vllm/slow-m", api_base=SLOW, name="slow")
    return Session(fast, slow, discovery=discovery, http=http, count_with_server=False, retry=RetryPolicy(attempts=1),
                   **kwargs)


def _answer():
    return {"id": "x", "object": "chat.completion", "model": "m", "created": 0,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class Backends:
    """Fast refuses connections; the first try at it also makes slow's window shrink (another replica's correction
    of it, read from the shared discovery) so that the request no longer fits slow. Slow answers whatever reaches it."""

    def __init__(self, discovery, slow):
        self.discovery, self.slow, self.to_slow = discovery, slow, 0

    def hit(self, url):
        if url.startswith(FAST):
            self.discovery.correct(self.slow, 600)
            raise httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("POST", url))
        self.to_slow += 1

    # a litellm-shaped client
    def completion(self, **kwargs):
        self.hit(kwargs["api_base"])
        return _answer()

    async def acompletion(self, **kwargs):
        return self.completion(**kwargs)

    # an httpx transport's inner transport
    def handle(self, request):
        self.hit(str(request.url))
        return httpx.Response(200, json=_answer())


def _drive(entry, s, backends):
    """One turn through ``entry``: what the caller got ("error" when the turn raised) and how often slow was sent to."""
    body = {"model": "fast-m", "messages": LONG, "max_tokens": 8}
    if entry in ("completion", "acompletion"):
        s._parts.client = backends
        try:
            if entry == "completion":
                s.completion(messages=LONG, max_tokens=8)
            else:
                asyncio.run(s.acompletion(messages=LONG, max_tokens=8))
        except httpx.ConnectError:
            return "error"
        return "answered"
    if entry in ("transport", "async transport"):
        from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport

        inner = httpx.MockTransport(backends.handle)
        try:
            if entry == "transport":
                with httpx.Client(transport=AgentKVTransport(s, inner)) as client:
                    client.post(f"{FAST}/chat/completions", json=body)
            else:
                async def post():
                    async with httpx.AsyncClient(transport=AsyncAgentKVTransport(s, inner)) as client:
                        await client.post(f"{FAST}/chat/completions", json=body)

                asyncio.run(post())
        except httpx.ConnectError:
            return "error"
        return "answered"
    if entry == "langchain router":
        return _through_the_router(s, backends)
    from agentkv.gateway.config import GatewayConfig
    from agentkv.gateway.context import GatewayContext
    from agentkv.gateway.relay import relay

    def reach(method, url, body):  # the one fake, raw POSTs too: a refused connection is the seam's one error
        try:
            backends.hit(url)
        except httpx.ConnectError as refused:
            raise HttpError(str(refused), kind="outage", reason="refused") from refused
        return _answer()

    upstream = FakeHttp(reach)
    ctx = GatewayContext(GatewayConfig(fast_url=FAST, fast_model="fast-m", slow_url=SLOW, slow_model="slow-m"),
                         upstream=upstream)
    reply = asyncio.run(relay(ctx, s, body))
    return "error" if reply.status == 502 else f"answered {reply.status}"


def _through_the_router(s, backends):
    """The LangChain router (ChatAgentKV) over two fake chat models that reach the Backends."""
    from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
    from langchain_core.messages import AIMessage, HumanMessage

    from agentkv.integrations.langchain import ChatAgentKV

    class Reaching(FakeMessagesListChatModel):
        url: str = ""

        def _generate(self, messages, stop=None, run_manager=None, **kwargs):
            backends.hit(self.url)
            return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)

    router = ChatAgentKV(Reaching(responses=[AIMessage(content="fast")], url=FAST),
                         Reaching(responses=[AIMessage(content="slow")], url=SLOW), s)
    try:
        router.invoke([HumanMessage(content=LONG[0]["content"])], max_tokens=8)
    except httpx.ConnectError:
        return "error"
    return "answered"


@pytest.mark.parametrize("entry", ["completion", "acompletion", "transport", "async transport", "gateway",
                                   "langchain router"])
def test_a_failover_after_a_window_change_decides_the_same_way_in_every_entry_point(entry):
    """Fast is down, and while its try failed slow's window shrank below the request: every entry point (the Session's
    twins, the OpenAI transport's, the gateway, the LangChain router) decides the failover on fresh facts, so none
    sends the request to slow, and the caller gets fast's outage."""
    http = FakeHttp(lambda m, u, b: models_answer("slow-m" if u.startswith(SLOW) else "fast-m",
                                                  16384 if u.startswith(SLOW) else 2048))
    discovery = WindowDiscovery(http=http)
    s = _session(discovery, http)
    backends = Backends(discovery, s.slow)
    assert _drive(entry, s, backends) == "error"
    assert backends.to_slow == 0 and s.stats()["failovers"] == 0


# ----------------------------------------------------------------------------- per-request state lives on the attempt

def test_two_concurrent_escalations_with_a_handoff_each_count_their_own_import():
    """Two escalations in flight at once in one Session, each with its own KV export: each answer's import is counted
    against the export its own request named (neither overwrites the other's)."""
    exports = iter(["a" * 32, "b" * 32])
    loaded = {"a" * 32: 300, "b" * 32: 500}

    def server(method, url, body):
        if url.endswith("/models"):
            return models_answer("slow-m" if url.startswith(SLOW) else "fast-m", 16384 if url.startswith(SLOW) else 2048)
        assert url == f"{FAST}/chat/completions" and body["kv_transfer_params"][KEY]["export"] is True
        return {"kv_transfer_params": {KEY: {"export_id": next(exports), "tokens": 900}}}

    class Slow:
        def __init__(self):
            self.arrived = 0

        async def acompletion(self, **kwargs):
            named = kwargs["extra_body"]["kv_transfer_params"][KEY]["import"]
            self.arrived += 1
            while self.arrived < 2:  # both escalations are in flight before either is answered
                await asyncio.sleep(0.001)
            if named == "a" * 32:
                await asyncio.sleep(0.01)  # the first export's answer comes last
            return {**_answer(), "kv_transfer_params": {KEY: {"imported": True, "tokens": loaded[named],
                                                               "reason": "mapped"}}}

    from agentkv import Handoff

    http = FakeHttp(server)
    s = _session(WindowDiscovery(http=http), http, client=Slow(), handoff=Handoff("identity", via="vllm"))

    async def both():
        await asyncio.gather(s.acompletion(messages=[{"role": "user", "content": "word " * 2500}], max_tokens=8),
                             s.acompletion(messages=[{"role": "user", "content": "other " * 2500}], max_tokens=8))

    with capture_events() as events:
        asyncio.run(both())
    imported = {e["export"]: e["mapped_tokens"] for e in events if e["event"] == "handoff.imported"}
    assert imported == {"a" * 12: 300, "b" * 12: 500}
    assert s.stats()["handoff_mapped"] == 2 and s.stats()["mapped_tokens"] == 800


def test_the_gateway_carries_a_handoffs_import_on_its_raw_body():
    """A raw body (the transport's, the gateway's) names the import as a top-level ``kv_transfer_params``, as vLLM
    reads it, and the export's salt goes with it."""
    from agentkv.handoff.served import import_request

    kwargs, salt = import_request({"messages": LONG}, "c" * 32, None, "salt", mapper_name=None, raw=True)
    assert kwargs["kv_transfer_params"] == {KEY: {"import": "c" * 32}} and "extra_body" not in kwargs
    assert salt == "salt"
    assert json.loads(json.dumps(kwargs))  # plain JSON


def test_the_gateway_takes_a_too_large_answer_once_and_names_the_limit():
    """A non-streamed answer over the reader's bound is not an outage: the gateway sends the request once, to fast,
    and answers 502 naming the limit (it is neither retried nor failed over to slow)."""
    from agentkv.errors import AnswerTooLarge
    from agentkv.gateway.config import GatewayConfig
    from agentkv.gateway.context import GatewayContext
    from agentkv.gateway.relay import relay

    class TooLarge(FakeHttp):
        async def post(self, url, content, headers=None):
            answer = await super().post(url, content)

            async def aread():
                raise AnswerTooLarge(1024)

            answer.aread = aread
            return answer

    http = FakeHttp(lambda m, u, b: models_answer("slow-m" if u.startswith(SLOW) else "fast-m",
                                                  16384 if u.startswith(SLOW) else 2048))
    s = _session(WindowDiscovery(http=http), http)
    upstream = TooLarge(lambda method, url, body: _answer())
    ctx = GatewayContext(GatewayConfig(fast_url=FAST, fast_model="fast-m", slow_url=SLOW, slow_model="slow-m"),
                         upstream=upstream)
    reply = asyncio.run(relay(ctx, s, {"model": "fast-m", "messages": LONG, "max_tokens": 8}))
    assert reply.status == 502 and b"over 1024 bytes" in reply.body
    assert [c.url for c in upstream.calls] == [f"{FAST}/chat/completions"]
