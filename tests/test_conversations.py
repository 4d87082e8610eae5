"""Conversations: one object serving many conversations, each through its own Session, under a tenant never taken from
what the caller sends; through the OpenAI-SDK transports (sync and async clients) and LangChain, against the embedded
servers.

``AGENTKV_TEST_CONVERSATIONS`` sets how many interleaved conversations the transport tests serve (9 by default, 3 per
tenant; the issue's figure is 200).
"""

import asyncio
import copy
import gc
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from agentkv import Backend, ConfigurationError, Conversations, Session, WarmAheadPolicy, derive_cache_salt
from agentkv.conversations import fingerprint, session_id, session_of
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.integrations.openai import AgentKVTransport, AsyncAgentKVTransport
from agent_checks import tokenize
from conftest import chat_requests

TOOLS8 = TOOLS[:8]
SECRET = "conversations-test-secret"
TENANTS = ("acme", "globex", "initech")
KEYS = {f"key-{tenant}": tenant for tenant in TENANTS}
MODES = ("header", "user", "fingerprint")
COUNT = int(os.environ.get("AGENTKV_TEST_CONVERSATIONS", "9"))
BLOCK = 16  # the embedded engine's prefix-cache block
PER_CONVERSATION_BYTES = 5 << 20  # a conversation's blocks at slow (its warm, its escalation: ~2,000 tokens of 2 KiB)


@pytest.fixture
def roomy(fresh):
    """The servers, the slow one's prefix cache sized so that every conversation's warm can wait for its escalation
    (the default 512 MiB holds about 100 of them); its budget is given back afterwards."""
    cache = fresh["slow"].engine.prefix_cache
    before = cache.budget_bytes
    cache.resize(max(before, COUNT * PER_CONVERSATION_BYTES))
    yield fresh
    cache.resize(before)


def tenant_of(request: httpx.Request) -> str:
    """As the gateway does: the API key names the tenant (an unknown key is refused)."""
    key = request.headers.get("authorization", "").removeprefix("Bearer ")
    if key not in KEYS:
        raise ConfigurationError("unknown API key")
    return KEYS[key]


def backends(fresh: dict[str, Any]) -> tuple[Backend, Backend]:
    return (Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast"),
            Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow"))


def secret_of(fresh: dict[str, Any]) -> str:
    """The test's own salt secret: the servers outlive a test, and their caches must not carry one test's blocks
    into another's figures."""
    return f"{SECRET}-{fresh['session_id']}"


def conversations(fresh: dict[str, Any], **kwargs: Any) -> Conversations:
    fast, slow = backends(fresh)
    options = {"tenant_of": tenant_of, "cache_salt_secret": secret_of(fresh), "discovery": fresh["discovery"],
               "warm_ahead": WarmAheadPolicy(max_in_flight=COUNT + 4, timeout_s=600), **kwargs}  # all warms wait
    return Conversations(fast, slow, **options)


@dataclass
class Plan:
    """One conversation of the interleaved run: its tenant, how it names itself, its messages so far."""

    tenant: str
    index: int  # within its tenant: conversation j of every tenant has the same text (only salts keep them apart)
    mode: str
    agent: ScriptedAgent = field(default_factory=lambda: ScriptedAgent(result_rows=1))
    messages: list[dict[str, Any]] = field(default_factory=list)
    escalation: Any = None  # the answer slow gave (its usage)
    system: str = ""

    def __post_init__(self) -> None:
        self.messages = self.agent.opening()
        self.system = self.messages[0]["content"] + f" [conversation {self.index}]"
        self.messages[0] = {**self.messages[0], "content": self.system}

    def request(self, model: str) -> dict[str, Any]:
        """The next call's arguments; every call also names another tenant in a header and in its body."""
        other = TENANTS[(TENANTS.index(self.tenant) + 1) % len(TENANTS)]
        kwargs: dict[str, Any] = {
            "model": model, "messages": copy.deepcopy(self.messages), "tools": TOOLS8, "max_tokens": 8,
            "extra_headers": {"X-Tenant": other}, "extra_body": {"tenant": other, "metadata": {"tenant": other}}}
        if self.mode == "header":
            kwargs["extra_headers"]["X-Session-ID"] = f"chat-{self.index}"
        elif self.mode == "user":
            kwargs["user"] = f"user-{self.index}"
        return kwargs

    def answered(self, answer: Any, slow_model: str) -> None:
        if answer.model == slow_model:
            self.escalation = answer
        else:
            self.messages += self.agent.next_turn()


def plans(count: int = COUNT) -> list[Plan]:
    """``count`` conversations, dealt round the tenants; within a tenant they cycle through the three identities."""
    return [Plan(TENANTS[i % 3], i // 3, MODES[(i // 3) % 3]) for i in range(count)]


def check_the_run(fresh: dict[str, Any], convs: Conversations, run: list[Plan]) -> float:
    """Every conversation escalated once onto its own warm (>= 0.95 of the warm's full blocks read from slow's cache)
    and read nothing beyond it: conversation j of each tenant has the same text, so an escalation reading another
    tenant's blocks would read more than its warm's. Every request carried its own tenant's salt, whatever it named.
    Returns the smallest share of the warm read."""
    salts = {tenant: derive_cache_salt(secret_of(fresh), tenant) for tenant in TENANTS}
    assert len(set(salts.values())) == len(TENANTS)
    for server in (fresh["fast"], fresh["slow"]):  # the client's own requests (the logs redact the API key: each
        for logged in server.requests:               # names the tenant after its own in X-Tenant)
            if logged.path == "/v1/chat/completions" and "x-tenant" in logged.headers:
                named = logged.headers["x-tenant"]
                assert logged.body["tenant"] == named and logged.body["cache_salt"] != salts[named]
                assert logged.body["cache_salt"] == salts[TENANTS[TENANTS.index(named) - 1]]
    slow_bodies = chat_requests(fresh["slow"])
    shares = []
    for plan in run:
        assert plan.escalation is not None, f"{plan.tenant} {plan.mode} {plan.index} never escalated"
        warms = [b for b in slow_bodies if b.get("max_tokens") == 1 and not b.get("stream")
                 and b["messages"][0]["content"] == plan.system and b.get("cache_salt") == salts[plan.tenant]]
        assert len(warms) == 1, (plan.tenant, plan.mode, plan.index, len(warms))
        full_blocks = len(tokenize(fresh["slow"], warms[0])) // BLOCK * BLOCK
        cached = plan.escalation.usage.prompt_tokens_details.cached_tokens
        shares.append(cached / full_blocks)
        assert 0.95 * full_blocks <= cached <= full_blocks, (plan.tenant, plan.mode, cached, full_blocks)
    stats = convs.stats()
    totals = stats["totals"]
    assert stats["conversations"] == len(run) and stats["dropped"] == 0
    assert totals["warm_fired"] == totals["escalations_after_warm"] == totals["escalations"] == len(run)
    assert totals["overflow_errors"] == 0
    tenants = sorted({key.split("/")[0] for key in stats["sessions"]})
    assert tenants == sorted({plan.tenant for plan in run})
    return min(shares)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kwargs,needle", [
    ({"tenant": "acme", "session_id": "chat-1"}, "session_id"),
    ({"tenant": "acme", "cache_salt": "one-salt-for-all"}, "cache_salt"),
    ({"tenant": "acme", "cache_salt": True}, "cache_salt"),
    ({}, "tenant"),
    ({"tenant": "acme", "tenant_of": tenant_of}, "tenant"),
    ({"tenant_of": "acme"}, "tenant_of"),
    ({"tenant": ""}, "tenant"),
    ({"tenant": "acme", "max_tokens": 5}, "max_tokens"),
    ({"tenant": "acme", "max_sessions": 0}, "max_sessions"),
])
def test_arguments_that_cannot_differ_per_conversation_are_refused(kwargs, needle):
    """A session_id, a fixed salt string, a missing or doubled tenant, a keyword Session does not take: refused by name
    at construction."""
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    with pytest.raises(ConfigurationError, match=needle):
        Conversations(fast, cache_salt_secret=SECRET, **kwargs)


def test_a_self_hosted_backend_without_a_salt_secret_is_refused(monkeypatch):
    """Tenants on a self-hosted backend need a secret to derive their salts from (or cache_salt=False, knowingly)."""
    monkeypatch.delenv("AGENTKV_CACHE_SALT_SECRET", raising=False)
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    with pytest.raises(ConfigurationError, match="secret"):
        Conversations(fast, tenant_of=tenant_of)
    assert Conversations(fast, tenant="acme", cache_salt=False).session_for("c")._parts.cache_salt is None


def test_a_bad_tenant_from_tenant_of_is_refused_before_anything_is_sent():
    """tenant_of's answer is checked like a Session's tenant, and the request never reaches the network."""
    sent = []
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    convs = Conversations(fast, tenant_of=lambda request: request.headers.get("x-tenant", ""), cache_salt_secret=SECRET)
    client = httpx.Client(transport=AgentKVTransport(convs, inner=httpx.MockTransport(sent.append)))
    for headers in ({}, {"authorization": "Bearer key-nobody"}):
        with pytest.raises(ConfigurationError, match="tenant_of"):
            client.post("http://127.0.0.1:9/v1/chat/completions", headers=headers,
                        json={"model": "f", "messages": [{"role": "user", "content": "hi"}]})
    assert sent == [] and len(convs) == 0


# ----------------------------------------------------------------------------- identity, bounds, concurrency
def test_a_conversation_is_its_explicit_id_else_its_user_else_its_opening_under_its_tenant():
    """The explicit id wins over the body's user, which wins over the opening; each tenant has its own Session for the
    same id, and a body field naming a tenant is never read."""
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    convs = Conversations(fast, tenant_of=lambda request: request, cache_salt_secret=SECRET)
    opening = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "tools": TOOLS8}
    later = {**opening, "messages": [*opening["messages"], {"role": "assistant", "content": "a"}]}
    named = convs.session_for("chat-1", opening, "acme")
    assert convs.session_for("chat-1", {"messages": [{"role": "user", "content": "a summary"}]}, "acme") is named
    assert convs.session_for(None, {**opening, "user": "u-1"}, "acme") is convs.session_for(None, {"user": "u-1"}, "acme")
    assert convs.session_for(None, opening, "acme") is convs.session_for(None, later, "acme")
    assert convs.session_for("chat-1", {**opening, "tenant": "globex"}, "acme") is named
    other = convs.session_for("chat-1", opening, "globex")
    assert other is not named and (other.tenant, named.tenant) == ("globex", "acme")
    assert other._parts.cache_salt == derive_cache_salt(SECRET, "globex") != named._parts.cache_salt
    assert named.session_id == session_id("h:chat-1") and "chat-1" not in named.session_id
    assert sorted(convs.stats()["sessions"]) == ["acme/f:" + fingerprint(opening), "acme/h:chat-1", "acme/u:u-1",
                                                 "globex/h:chat-1"]


def test_memory_stays_flat_past_max_sessions_and_dropped_sessions_are_freed():
    """Past max_sessions the least recently used conversation is dropped and its Session freed, but not closed: a
    request that took it just before the drop is still answered (a Session with nothing to release is let go); one
    idle idle_s is dropped at the next call (the map's clock is the injected one)."""
    now = [0.0]
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    convs = Conversations(fast, tenant="acme", cache_salt_secret=SECRET, max_sessions=4, idle_s=60,
                          clock=lambda: now[0])
    seen = [convs.session_for(f"chat-{i}") for i in range(40)]
    assert len(convs) == 4 and convs.stats()["dropped"] == 36
    assert not any(s.closed for s in seen)  # a dropped Session still serves the request that holds it
    refs = [weakref.ref(s) for s in seen[:-4]]
    del seen
    gc.collect()
    assert not any(ref() for ref in refs)  # nothing else holds a dropped conversation's Session
    now[0] = 61.0
    convs.session_for("chat-new")
    assert len(convs) == 1 and convs.stats()["dropped"] == 40


def test_concurrent_calls_for_one_conversation_get_one_session():
    """Sixteen threads asking at once for one new conversation get the same Session."""
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    convs = Conversations(fast, tenant="acme", cache_salt_secret=SECRET)
    barrier, got = threading.Barrier(16), []

    def ask() -> None:
        barrier.wait()
        got.append(convs.session_for(None, {"messages": [{"role": "user", "content": "same opening"}]}))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 16 and len({id(s) for s in got}) == 1 and len(convs) == 1


def test_close_closes_every_session_and_session_of_passes_a_session_through():
    """close() closes every Session held and refuses new conversations; a Session given to session_of is the answer."""
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    with Conversations(fast, tenant="acme", cache_salt_secret=SECRET) as convs:
        held = [session_of(convs, conversation=f"c{i}") for i in range(3)]
    assert all(s.closed for s in held) and len(convs) == 0
    with pytest.raises(RuntimeError, match="closed"):
        convs.session_for("c0")
    single = Session(fast, tenant="acme", cache_salt_secret=SECRET)
    assert session_of(single, conversation="ignored") is single


async def test_aclose_closes_every_session():
    """The async twin of close()."""
    fast = Backend("hosted_vllm/f", api_base="http://127.0.0.1:9/v1", name="fast")
    async with Conversations(fast, tenant="acme", cache_salt_secret=SECRET) as convs:
        held = [convs.session_for(f"c{i}") for i in range(3)]
    assert all(s.closed for s in held)


# ----------------------------------------------------------------------------- through the OpenAI SDK
def test_one_sync_transport_serves_interleaved_conversations_of_three_tenants(roomy):
    """openai.OpenAI (one key per tenant) over one AgentKVTransport: each conversation escalates onto its own warm,
    and every request carries its tenant's salt, though each names another tenant in a header and its body."""
    fresh = roomy
    started = time.perf_counter()
    run, slow_model = plans(), fresh["slow"].model_id
    with conversations(fresh) as convs:
        http = httpx.Client(transport=AgentKVTransport(convs))
        clients = {t: openai.OpenAI(base_url=fresh["fast"].api_base, api_key=f"key-{t}", max_retries=0,
                                    http_client=http) for t in TENANTS}
        for _ in range(30):
            live = [plan for plan in run if plan.escalation is None]
            if not live:
                break
            for plan in live:
                answer = clients[plan.tenant].chat.completions.create(**plan.request(fresh["fast"].model_id))
                plan.answered(answer, slow_model)
            assert convs.drain_warms(30)
        share = check_the_run(fresh, convs, run)
    print(f"conversations-sync: {len(run)} conversations, smallest share of the warm read {share:.3f}, "
          f"{time.perf_counter() - started:.1f}s")


async def test_one_async_transport_serves_interleaved_conversations_concurrently(roomy):
    """openai.AsyncOpenAI over one AsyncAgentKVTransport, every live conversation's turn sent at once: the same."""
    fresh = roomy
    started = time.perf_counter()
    run, slow_model = plans(), fresh["slow"].model_id
    async with conversations(fresh) as convs:
        http = httpx.AsyncClient(transport=AsyncAgentKVTransport(convs))
        clients = {t: openai.AsyncOpenAI(base_url=fresh["fast"].api_base, api_key=f"key-{t}", max_retries=0,
                                         http_client=http) for t in TENANTS}

        async def turn(plan: Plan) -> None:
            answer = await clients[plan.tenant].chat.completions.create(**plan.request(fresh["fast"].model_id))
            plan.answered(answer, slow_model)

        for _ in range(30):
            live = [plan for plan in run if plan.escalation is None]
            if not live:
                break
            await asyncio.gather(*(turn(plan) for plan in live))
            await convs.adrain_warms(30)
        share = check_the_run(fresh, convs, run)
    print(f"conversations-async: {len(run)} conversations, smallest share of the warm read {share:.3f}, "
          f"{time.perf_counter() - started:.1f}s")


def test_an_explicit_id_keeps_its_session_when_the_history_is_rebuilt(fresh):
    """A conversation named by X-Session-ID keeps its Session when its history is replaced by a summary; one named by
    its opening alone becomes another conversation."""
    with conversations(fresh) as convs:
        client = openai.OpenAI(base_url=fresh["fast"].api_base, api_key="key-acme", max_retries=0,
                               http_client=httpx.Client(transport=AgentKVTransport(convs)))
        plan = Plan("acme", 0, "header")
        for _ in range(3):
            plan.answered(client.chat.completions.create(**plan.request(fresh["fast"].model_id)), "")
        summary = [plan.messages[0], {"role": "user", "content": "Summary of the work so far: three tools called."}]
        for headers in ({"X-Session-ID": "chat-0"}, {}):
            client.chat.completions.create(model=fresh["fast"].model_id, messages=summary, max_tokens=8,
                                           extra_headers=headers)
        sessions = convs.stats()["sessions"]
    assert sessions["acme/h:chat-0"]["requests"] == {"fast": 4}
    assert len(sessions) == 2 and [k for k in sessions if k.startswith("acme/f:")]


async def test_two_concurrent_calls_for_a_new_conversation_share_one_session(fresh):
    """Two requests of one new conversation sent at once through the async transport go through one Session."""
    async with conversations(fresh) as convs:
        client = openai.AsyncOpenAI(base_url=fresh["fast"].api_base, api_key="key-globex", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=AsyncAgentKVTransport(convs)))
        plan = Plan("globex", 0, "fingerprint")
        await asyncio.gather(*(client.chat.completions.create(**plan.request(fresh["fast"].model_id))
                               for _ in range(2)))
        stats = convs.stats()
    assert stats["conversations"] == 1 and stats["totals"]["requests"] == {"fast": 2}


def test_the_transport_keeps_memory_flat_past_max_sessions(fresh):
    """Through the transport, past max_sessions the map holds max_sessions conversations and every turn is answered."""
    with conversations(fresh, max_sessions=2) as convs:
        client = openai.OpenAI(base_url=fresh["fast"].api_base, api_key="key-initech", max_retries=0,
                               http_client=httpx.Client(transport=AgentKVTransport(convs)))
        run = [Plan("initech", j, "fingerprint") for j in range(5)]
        for _ in range(2):
            for plan in run:
                plan.answered(client.chat.completions.create(**plan.request(fresh["fast"].model_id)), "")
                assert len(convs) <= 2
        assert convs.stats()["dropped"] == 8


# ----------------------------------------------------------------------------- through LangChain and LangGraph
def lc_history(turns: int) -> list[Any]:
    """The scripted agent's conversation after ``turns`` tool turns, as LangChain messages."""
    from langchain_core.messages import convert_to_messages

    agent = ScriptedAgent(result_rows=1)
    messages = agent.opening()
    for _ in range(turns):
        messages += agent.next_turn()
    return convert_to_messages(messages)


def fake_model(**kwargs: Any) -> Any:
    from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
    from langchain_core.messages import AIMessage

    return FakeMessagesListChatModel(responses=[AIMessage(content="ok")], **kwargs)


def graph_of(chat: Any) -> Any:
    """A one-node LangGraph graph calling ``chat`` on its state's messages (which each run's input replaces)."""
    from typing import TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, StateGraph

    class State(TypedDict):
        messages: list[Any]

    async def acall(state: State) -> State:
        return {"messages": [*state["messages"], await chat.ainvoke(state["messages"])]}

    def call(state: State) -> State:
        return {"messages": [*state["messages"], chat.invoke(state["messages"])]}

    from langchain_core.runnables import RunnableLambda

    graph = StateGraph(State)
    graph.add_node("model", RunnableLambda(call, afunc=acall))
    graph.add_edge(START, "model")
    return graph.compile(checkpointer=InMemorySaver())


def test_chat_agentkv_serves_each_langgraph_thread_through_its_own_session(fresh):
    """One ChatAgentKV over a Conversations: a LangGraph thread_id keeps its Session when the history is replaced by a
    summary; another thread gets another; a call outside any thread is named by its opening."""
    pytest.importorskip("langgraph")
    from langchain_core.messages import HumanMessage

    from agentkv.integrations.langchain import ChatAgentKV

    fast, slow = backends(fresh)
    with Conversations(fast, slow, tenant="acme", cache_salt_secret=secret_of(fresh),
                       discovery=fresh["discovery"]) as convs:
        graph = graph_of(ChatAgentKV(fake_model(), fake_model(), convs))
        summary = [lc_history(0)[0], HumanMessage(content="Summary so far: two tools called, nothing found.")]
        for messages in (lc_history(2), summary):
            graph.invoke({"messages": messages}, config={"configurable": {"thread_id": "t-1"}})
        graph.invoke({"messages": lc_history(2)}, config={"configurable": {"thread_id": "t-2"}})
        asyncio.run(graph.ainvoke({"messages": lc_history(1)}, config={"configurable": {"thread_id": "t-3"}}))
        ChatAgentKV(fake_model(), fake_model(), convs).invoke(lc_history(1))
        ChatAgentKV(fake_model(), fake_model(), convs).invoke(lc_history(3))
        sessions = convs.stats()["sessions"]
    assert sessions["h:t-1"]["requests"] == {"fast": 2}
    assert sessions["h:t-2"]["requests"] == sessions["h:t-3"]["requests"] == {"fast": 1}
    (opening,) = [key for key in sessions if key.startswith("f:")]
    assert sessions[opening]["requests"] == {"fast": 2} and len(sessions) == 4


def test_the_callback_handler_accounts_each_call_in_its_threads_session(fresh):
    """AgentKVCallbackHandler over a Conversations: each observed call lands in its thread's Session (LangGraph's
    thread_id, or metadata outside a graph), else its opening's; the async twin likewise."""
    pytest.importorskip("langgraph")
    from agentkv.integrations.langchain import AgentKVCallbackHandler, AsyncAgentKVCallbackHandler

    fast, slow = backends(fresh)
    with Conversations(fast, slow, tenant="acme", cache_salt_secret=secret_of(fresh),
                       discovery=fresh["discovery"]) as convs:
        handler, chat = AgentKVCallbackHandler(convs), fake_model()
        graph_of(chat).invoke({"messages": lc_history(1)},
                              config={"configurable": {"thread_id": "t-9"}, "callbacks": [handler]})
        chat.invoke(lc_history(2), config={"callbacks": [handler], "metadata": {"thread_id": "t-9"}})
        chat.invoke(lc_history(1), config={"callbacks": [handler]})
        asyncio.run(chat.ainvoke(lc_history(1), config={"callbacks": [AsyncAgentKVCallbackHandler(convs)],
                                                        "metadata": {"thread_id": "t-10"}}))
        ledgers = {key: len(convs.session_for(key.removeprefix("h:")).ledger)
                   for key in convs.stats()["sessions"] if key.startswith("h:")}
        assert len(convs) == 3 and handler.counters["observed"] == 3 and handler.runs == {}
    assert ledgers == {"h:t-9": 2, "h:t-10": 1}
