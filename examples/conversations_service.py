"""An agent service: one Conversations behind one openai client serves every conversation of every tenant.

    python examples/conversations_service.py [--quick]

A service builds its model client once, at start-up. With agentkv that client is
``openai.OpenAI(http_client=httpx.Client(transport=AgentKVTransport(convs)))``, where ``convs`` is one
``Conversations(fast, slow, tenant_of=..., cache_salt_secret=...)``. Each request then goes through its own
conversation's Session: the one its ``X-Session-ID`` header names, else its body's ``user``, else the digest of its
opening; under the tenant ``tenant_of`` reads from the API key (never from anything the caller sends). Here three
tenants run a few conversations each, interleaved turn by turn; conversation j of every tenant has the same text, so
only the tenants' salts keep their caches apart. Each conversation outgrows the fast window and escalates to slow,
where its own warm has prefilled it: slow's ``cached_tokens`` is the warm's full blocks, no more (no other tenant's).
The agent's tool calls are scripted (random-weight models); every request still reaches a real engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from _support import parse_args, quiet_logs, servers

from agentkv import Conversations, Session
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.integrations.openai import AgentKVTransport

KEYS = {"key-acme": "acme", "key-globex": "globex", "key-initech": "initech"}  # the service's API keys
IDENTITIES = ("header", "user", "opening")
URL = "{}/chat/completions"


def tenant_of(request: httpx.Request) -> str:
    """As a gateway does: the API key names the tenant."""
    return KEYS[request.headers["authorization"].removeprefix("Bearer ")]


@dataclass
class Chat:
    """One conversation: its tenant, how it names itself, its messages so far, the slow server's answer."""

    tenant: str
    index: int  # within its tenant: chat j of every tenant has the same text
    identity: str  # how its requests name it: an X-Session-ID header, the body's user, or nothing (its opening)
    agent: ScriptedAgent = field(default_factory=lambda: ScriptedAgent(result_rows=1))
    messages: list[dict[str, Any]] = field(default_factory=list)
    escalation: Any = None

    def __post_init__(self) -> None:
        self.messages = self.agent.opening()
        self.messages[0] = {**self.messages[0], "content": f"{self.messages[0]['content']} [chat {self.index}]"}

    def request(self, model: str) -> dict[str, Any]:
        """The next call; it names itself by header, by ``user``, or not at all (its opening). It also names another
        tenant in a header, which changes nothing: the tenant is the API key's."""
        other = next(t for t in KEYS.values() if t != self.tenant)
        call: dict[str, Any] = {"model": model, "messages": self.messages, "tools": TOOLS[:8], "max_tokens": 8,
                                "extra_headers": {"X-Tenant": other}}
        if self.identity == "header":
            call["extra_headers"]["X-Session-ID"] = f"chat-{self.index}"
        elif self.identity == "user":
            call["user"] = f"user-{self.index}"
        return call

    def session(self, convs: Conversations, url: str) -> Session:
        """This conversation's Session, found as the transport finds it."""
        request = httpx.Request("POST", url, headers={"authorization": f"Bearer key-{self.tenant}"})
        header = f"chat-{self.index}" if self.identity == "header" else None
        user = f"user-{self.index}" if self.identity == "user" else None
        body = {"messages": self.messages, "tools": TOOLS[:8], "user": user}
        return convs.session_for(header, body, request)


def read_its_warm(chat: Chat, convs: Conversations, url: str, block: int) -> tuple[bool, str]:
    """Whether the escalation read its warm (>= 0.95 of the warm's full blocks, and nothing beyond), and a line."""
    session = chat.session(convs, url)
    fired = next(row for row in session.ledger if row.warm == "fire")
    escalated = next(row for row in session.ledger if row.backend == "slow")
    full = fired.input_tokens // block * block
    cached = chat.escalation.usage.prompt_tokens_details.cached_tokens
    ok = 0.95 * full <= cached <= full
    return ok, (f"{chat.tenant:<8} chat {chat.index} (by {chat.identity:<7}) escalated at turn {escalated.turn} with "
                f"{escalated.input_tokens} tokens; slow had {cached} cached, its warm {full} in full blocks: "
                f"{'read its warm, nothing beyond' if ok else 'MISSED its warm'}")


def serve(convs: Conversations, clients: dict[str, openai.OpenAI], chats: list[Chat], env: Any) -> None:
    """One turn of every live conversation, interleaved, until each has escalated to slow."""
    for _ in range(30):
        live = [c for c in chats if c.escalation is None]
        if not live:
            return
        for chat in live:
            answer = clients[chat.tenant].chat.completions.create(**chat.request(env.fast_server.model_id))
            route = chat.session(convs, URL.format(env.fast.api_base)).last_route  # --quick: one model id for both
            if route is not None and route.role == "slow":
                chat.escalation = answer
            else:
                chat.messages += chat.agent.next_turn()
        convs.drain_warms(60)  # only so the demo's numbers do not depend on timing


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    quiet_logs()
    per_tenant = 2 if args.quick else 4
    with servers(args.quick) as env, Conversations(env.fast, env.slow, tenant_of=tenant_of,
                                                   cache_salt_secret="example-secret") as convs:
        http = httpx.Client(transport=AgentKVTransport(convs))  # one transport for the whole service
        clients = {t: openai.OpenAI(base_url=env.fast.api_base, api_key=k, http_client=http) for k, t in KEYS.items()}
        chats = [Chat(tenant, j, IDENTITIES[(t + j) % len(IDENTITIES)])
                 for j in range(per_tenant) for t, tenant in enumerate(KEYS.values())]
        serve(convs, clients, chats, env)
        block = env.slow_server.engine.prefix_cache.block_size
        results = [read_its_warm(chat, convs, URL.format(env.fast.api_base), block) for chat in chats]
        for _, line in results:
            print(line)
        stats = convs.stats()
        totals = {k: v for k, v in stats["totals"].items() if v and k != "requests_total"}
        print(f"convs.stats(): {stats['conversations']} conversations held, {stats['dropped']} dropped; totals {totals}")
        print(f"conversations_service: {len(chats)} conversations of {len(KEYS)} tenants through one transport, "
              f"{sum(ok for ok, _ in results)} escalations read their own warm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
