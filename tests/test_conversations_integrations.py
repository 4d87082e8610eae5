"""One Conversations serving interleaved conversations of three tenants through one transport, one middleware and one
litellm provider at once, against the embedded servers (issue 38's "Done when").

Conversations are dealt in groups of three (one per tenant, the same text, through the same integration); the groups
go round the integrations: the OpenAI SDK over one ``AgentKVTransport`` (three clients, one API key per tenant), a
``create_agent`` agent with one ``AgentKVMiddleware`` (LangGraph's ``thread_id``, the caller's key in the run's
context), and ``litellm.completion(model="<name>/fast")`` through one registered provider (``metadata.session_id``,
the call's ``api_key``). Each integration hands ``tenant_of`` something else (the ``httpx.Request``, LangChain's
``ModelRequest``, the provider's call: see :func:`tenant_of`); every request also names another tenant in a header and
in its body. The map holds fewer Sessions than there are conversations: groups start as earlier ones finish, and
finished conversations are dropped.

``AGENTKV_TEST_CONVERSATIONS`` sets how many conversations are served (9 by default; the issue's figure is 200).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import httpx
import openai
import pytest

pytest.importorskip("langchain.agents")

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, BaseMessage, convert_to_messages
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agentkv import ConfigurationError, Conversations, Session, WarmAheadPolicy, derive_cache_salt
from agentkv.demo.script import ScriptedAgent
from agentkv.integrations.langchain import AgentKVMiddleware
from agentkv.integrations.litellm import register, unregister
from agentkv.integrations.openai import AgentKVTransport
from agentkv.testing import ScriptedTransport
from agent_checks import tokenize
from conftest import chat_requests
from test_conversations import BLOCK, KEYS, PER_CONVERSATION_BYTES, TENANTS, TOOLS8, backends, secret_of

COUNT = int(os.environ.get("AGENTKV_TEST_CONVERSATIONS", "9"))
GROUPS = math.ceil(COUNT / len(TENANTS))
LIVE = max(1, GROUPS * 2 // 3)  # groups served at once: the rest wait for one to finish
MAX_SESSIONS = min(COUNT - 1, len(TENANTS) * LIVE + len(TENANTS)) if COUNT > 1 else 1  # fewer than the conversations
VIA = ("transport", "middleware", "provider")
MODES = ("header", "user", "fingerprint")  # how a transport conversation names itself
PROVIDER = "agentkv-many"
PROMPT = "You are an SRE agent. Investigate with the tools, then answer in one line."
MAX_ROUNDS = 60 + GROUPS


@pytest.fixture
def roomy(fresh):
    """The servers, the slow one's prefix cache sized so that every conversation's warm can wait for its escalation;
    its budget is given back afterwards."""
    cache = fresh["slow"].engine.prefix_cache
    before = cache.budget_bytes
    cache.resize(max(before, COUNT * PER_CONVERSATION_BYTES))
    yield fresh
    cache.resize(before)


def tenant_of(request: Any) -> str:
    """The tenant from the caller's API key, wherever the integration hands it: the ``httpx.Request``'s bearer
    (transport), the run's context of LangChain's ``ModelRequest`` (middleware), the call's ``api_key`` (litellm
    provider). Nothing the caller names in a header or the body is read."""
    if isinstance(request, httpx.Request):
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
    elif isinstance(request, Mapping):
        key = request.get("api_key")
    else:
        key = getattr(getattr(getattr(request, "runtime", None), "context", None), "key", None)
    if key not in KEYS:
        raise ConfigurationError("unknown API key")
    return KEYS[key]


def other_tenant(tenant: str) -> str:
    return TENANTS[(TENANTS.index(tenant) + 1) % len(TENANTS)]


@dataclass
class Caller:
    """A create_agent run's context: the caller's API key (what tenant_of reads)."""

    key: str


class Recorded(Conversations):
    """A Conversations that remembers, weakly, every Session it handed out: the test drains their warms (a dropped
    one's too) and counts those still alive, without keeping any alive itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: weakref.WeakSet[Session] = weakref.WeakSet()

    def session_for(self, conversation: str | None = None, body: Mapping[str, Any] | None = None,
                    request: Any = None) -> Session:
        session = super().session_for(conversation, body, request)
        self.seen.add(session)
        return session

    def drain_all(self, timeout_s: float = 30.0) -> bool:
        return all([session.drain_warms(timeout_s) for session in list(self.seen)])


class NamesAnotherTenant(AgentMiddleware):  # type: ignore[misc]
    """Before agentkv's middleware: every model call names another tenant in a header and in its body."""

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        other = other_tenant(KEYS[request.runtime.context.key])
        settings = {**(request.model_settings or {}), "extra_headers": {"X-Tenant": other},
                    "extra_body": {"tenant": other, "metadata": {"tenant": other}}}
        return handler(request.override(model_settings=settings))


@tool
def lookup(topic: str) -> str:
    """Look up the fleet's records about a topic."""
    return f"no records about {topic}"


@dataclass
class Conv:
    """One conversation: its tenant, its group (the same text in every tenant), the integration serving it."""

    tenant: str
    group: int
    via: str
    agent: ScriptedAgent = field(default_factory=lambda: ScriptedAgent(result_rows=1))
    messages: list[Any] = field(default_factory=list)
    first_user: str = ""
    cached: int | None = None  # slow's cached tokens for the escalation, once it happened
    turns: int = 0

    def __post_init__(self) -> None:
        system, user = self.agent.opening()
        self.first_user = f"{user['content']} [conversation {self.group}]"
        opening = [{**system, "content": f"{system['content']} [conversation {self.group}]"},
                   {**user, "content": self.first_user}]
        self.messages = convert_to_messages(opening[1:]) if self.via == "middleware" else opening

    @property
    def key(self) -> str:
        return f"key-{self.tenant}"

    @property
    def mode(self) -> str:
        return MODES[(self.group // len(VIA)) % len(MODES)] if self.via == "transport" else "header"

    @property
    def explicit_id(self) -> str:
        return {"transport": "chat", "middleware": "thread", "provider": "litellm"}[self.via] + f"-{self.group}"


class Served:
    """The three integrations over one Conversations, and one turn of a conversation through its own."""

    def __init__(self, fresh: dict[str, Any], convs: Conversations, litellm: Any) -> None:
        self.fresh, self.litellm = fresh, litellm
        self.fast_model, self.slow_model = fresh["fast"].model_id, fresh["slow"].model_id
        http = httpx.Client(transport=AgentKVTransport(convs))
        self.clients = {t: openai.OpenAI(base_url=fresh["fast"].api_base, api_key=f"key-{t}", max_retries=0,
                                         http_client=http) for t in TENANTS}
        scripted = httpx.Client(transport=ScriptedTransport(["ok"] * (COUNT * 60)))  # random weights: a fixed reply

        def chat(server: Any) -> ChatOpenAI:
            return ChatOpenAI(model=server.model_id, base_url=server.api_base, api_key="-", max_tokens=8,
                              max_retries=0, http_client=scripted)

        self.middleware = AgentKVMiddleware(convs, slow=chat(fresh["slow"]))
        self.agent = create_agent(model=chat(fresh["fast"]), tools=[lookup], system_prompt=PROMPT,
                                  middleware=[NamesAnotherTenant(), self.middleware], context_schema=Caller)
        self.provider = register(PROVIDER, convs)

    def turn(self, conv: Conv) -> None:
        """One model call of ``conv`` through its integration; its history grows by a tool turn, or it escalated."""
        conv.turns += 1
        {"transport": self._transport, "middleware": self._middleware, "provider": self._provider}[conv.via](conv)

    def _transport(self, conv: Conv, messages: list[Any] | None = None) -> Any:
        other = other_tenant(conv.tenant)
        kwargs: dict[str, Any] = {
            "model": self.fast_model, "messages": copy.deepcopy(messages or conv.messages), "tools": TOOLS8,
            "max_tokens": 8, "extra_headers": {"X-Tenant": other},
            "extra_body": {"tenant": other, "metadata": {"tenant": other}}}
        if conv.mode == "header":
            kwargs["extra_headers"]["X-Session-ID"] = conv.explicit_id
        elif conv.mode == "user":
            kwargs["user"] = f"user-{conv.group}"
        answer = self.clients[conv.tenant].chat.completions.create(**kwargs)
        if messages is None:
            self._answered(conv, answer.model, answer.usage.prompt_tokens_details.cached_tokens)
        return answer

    def _provider(self, conv: Conv, messages: list[Any] | None = None) -> Any:
        other = other_tenant(conv.tenant)
        answer = self.litellm.completion(
            model=f"{PROVIDER}/fast", messages=copy.deepcopy(messages or conv.messages), tools=TOOLS8, max_tokens=8,
            api_key=conv.key, metadata={"session_id": conv.explicit_id, "tenant": other},
            extra_headers={"X-Tenant": other}, extra_body={"tenant": other, "metadata": {"tenant": other}})
        if messages is None:
            self._answered(conv, answer.model, answer.usage.prompt_tokens_details.cached_tokens)
        return answer

    def _middleware(self, conv: Conv, messages: list[BaseMessage] | None = None) -> Any:
        """A run of the agent on the conversation's history, passed whole each time (no checkpointer: the framework
        rebuilds its state from the input); the thread id is the same in every tenant."""
        other = other_tenant(conv.tenant)
        config = {"configurable": {"thread_id": conv.explicit_id, "tenant": other}, "metadata": {"tenant": other}}
        result = self.agent.invoke({"messages": list(messages or conv.messages)}, config, context=Caller(conv.key))
        answer = result["messages"][-1]
        assert isinstance(answer, AIMessage)
        if messages is None:
            conv.messages = result["messages"]
            cached = (answer.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0)
            self._answered(conv, answer.response_metadata.get("model_name", ""), cached)
        return result

    def _answered(self, conv: Conv, model: str, cached: int | None) -> None:
        if self.slow_model in model:
            conv.cached = int(cached or 0)
            return
        turn = conv.agent.next_turn()
        conv.messages = conv.messages + (convert_to_messages(turn) if conv.via == "middleware" else turn)

    def rebuilt(self, conv: Conv) -> None:
        """A call of ``conv`` whose history the framework replaced by a summary (same explicit id, new opening)."""
        summary = [{"role": "user", "content": f"Summary of conversation {conv.group} so far: nothing found."}]
        if conv.via == "middleware":
            self._middleware(conv, convert_to_messages(summary))
        else:
            system = conv.messages[0]
            getattr(self, f"_{conv.via}")(conv, [system, *summary])


def the_run() -> list[Conv]:
    """COUNT conversations: group g holds one per tenant (the same text), served through VIA[g % 3]."""
    return [Conv(TENANTS[i % len(TENANTS)], i // len(TENANTS), VIA[(i // len(TENANTS)) % len(VIA)])
            for i in range(COUNT)]


def serve(served: Served, convs: Recorded, run: list[Conv]) -> dict[str, int]:
    """Serve the conversations in rounds: LIVE groups at a time (a finished group's place taken by the next), one
    turn of every live conversation per round, interleaved across tenants and integrations. Returns the peaks of
    the map and of the Sessions alive."""
    waiting = deque(sorted({c.group for c in run}))
    live: list[list[Conv]] = []
    peak = {"held": 0, "alive": 0}
    for _ in range(MAX_ROUNDS):
        while len(live) < LIVE and waiting:
            group = waiting.popleft()
            live.append([c for c in run if c.group == group])
        if not live:
            break
        for conv in [c for group in live for c in group if c.cached is None]:
            served.turn(conv)
            peak["held"] = max(peak["held"], len(convs))
            assert len(convs) <= MAX_SESSIONS
        assert convs.drain_all(60)
        live = [group for group in live if any(c.cached is None for c in group)]
        gc.collect()
        peak["alive"] = max(peak["alive"], len(convs.seen))
    return peak


def check_the_run(fresh: dict[str, Any], run: list[Conv]) -> list[float]:
    """Each conversation: one warm, salted for its tenant, and its escalation read >= 0.95 of the warm's full blocks and
    no more (group g has the same text in every tenant: reading another tenant's blocks would read past the warm).
    Each request that names another tenant (header and body) carries its own tenant's salt, in every integration.
    Returns each conversation's share of its warm read."""
    salts = {tenant: derive_cache_salt(secret_of(fresh), tenant) for tenant in TENANTS}
    by_user = {(c.first_user, c.tenant): c for c in run}
    named: dict[str, int] = {}
    for server in (fresh["fast"], fresh["slow"]):
        for logged in server.requests:
            if logged.path != "/v1/chat/completions" or "x-tenant" not in logged.headers:
                continue
            other = logged.headers["x-tenant"]
            tenant = TENANTS[TENANTS.index(other) - 1]
            assert logged.body["tenant"] == other and logged.body["cache_salt"] == salts[tenant]
            conv = by_user.get((user_of(logged.body), tenant))
            if conv is not None:
                named[conv.via] = named.get(conv.via, 0) + 1
    assert set(named) == {c.via for c in run}, named  # every integration's requests named another tenant
    slow_bodies = chat_requests(fresh["slow"])
    shares = []
    for conv in run:
        assert conv.cached is not None, f"{conv.tenant} {conv.via} {conv.group} never escalated ({conv.turns} turns)"
        warms = [b for b in slow_bodies if b.get("max_tokens") == 1 and not b.get("stream")
                 and user_of(b) == conv.first_user and b.get("cache_salt") == salts[conv.tenant]]
        assert len(warms) == 1, (conv.tenant, conv.via, conv.group, len(warms))
        full_blocks = len(tokenize(fresh["slow"], warms[0])) // BLOCK * BLOCK
        shares.append(conv.cached / full_blocks)
        assert 0.95 * full_blocks <= conv.cached <= full_blocks, (conv.tenant, conv.via, conv.cached, full_blocks)
    warms = [b for b in slow_bodies if b.get("max_tokens") == 1 and not b.get("stream")]
    assert len(warms) == len(run)  # no conversation warmed twice, though dropped from the map and built again
    return shares


def user_of(body: Mapping[str, Any]) -> Any:
    """The first user message's content (which conversation a request belongs to)."""
    return next((m.get("content") for m in body.get("messages", ()) if m.get("role") == "user"), None)


def check_rebuilt(served: Served, convs: Conversations, run: list[Conv]) -> None:
    """A conversation named by an explicit id (X-Session-ID, thread_id, metadata.session_id) keeps its Session when its
    history is replaced by a summary: the call lands in that Session, and no other is built."""
    for via in VIA:
        conv = next((c for c in reversed(run) if c.via == via and c.mode == "header"), None)
        if conv is None:
            continue
        session = convs.session_for(conv.explicit_id, request={"api_key": conv.key})
        requests, built = session.stats()["requests_total"], len(convs) + convs.dropped
        served.rebuilt(conv)
        assert convs.session_for(conv.explicit_id, request={"api_key": conv.key}) is session
        assert session.stats()["requests_total"] == requests + 1 and len(convs) + convs.dropped == built


def test_one_conversations_serves_a_transport_a_middleware_and_a_provider_at_once(roomy):
    """One Conversations, three tenants, three integrations, interleaved: each conversation escalates onto its own
    warm and reads no other tenant's cache; every request carries its tenant's salt whatever it names; the map and
    the Sessions alive stay within max_sessions past it; an explicit id keeps its Session through a rebuilt history."""
    from agentkv._support.env import import_litellm

    fresh, litellm = roomy, import_litellm()
    started = time.perf_counter()
    run = the_run()
    fast, slow = backends(fresh)
    convs = Recorded(fast, slow, tenant_of=tenant_of, cache_salt_secret=secret_of(fresh),
                     discovery=fresh["discovery"], max_sessions=MAX_SESSIONS,
                     warm_ahead=WarmAheadPolicy(max_in_flight=COUNT + 4, timeout_s=600))
    try:
        served = Served(fresh, convs, litellm)
        peak = serve(served, convs, run)
        stats = convs.stats()
        shares = check_the_run(fresh, run)
        check_rebuilt(served, convs, run)
        assert stats["totals"].get("overflow_errors", 0) == 0
        assert peak["held"] <= MAX_SESSIONS < len(run) and peak["alive"] <= MAX_SESSIONS
        assert stats["dropped"] >= len(run) - MAX_SESSIONS
    finally:
        unregister(PROVIDER)
        convs.close()
    gc.collect()
    split = ", ".join(f"{via} {sum(c.via == via for c in run)}" for via in VIA)
    print(f"conversations-integrations: {len(run)} conversations ({split}), "
          f"share of the warm read min {min(shares):.3f} mean {sum(shares) / len(shares):.3f}, "
          f"max_sessions {MAX_SESSIONS}, held at most {peak['held']}, Sessions alive at most {peak['alive']}, "
          f"dropped {stats['dropped']}, turns {sum(c.turns for c in run)}, {time.perf_counter() - started:.1f}s")
