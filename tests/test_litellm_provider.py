"""The litellm provider: ``litellm.completion(model="agentkv/<alias>")`` runs through a conversation's Session.

Plain litellm calls (sync, async, streamed) and two litellm-based frameworks (smolagents' ``LiteLLMModel`` with a
``ToolCallingAgent``, Google ADK's ``LiteLlm`` in an ``LlmAgent``) against the embedded servers. The models have
random weights, so the Session's client scripts the tool calls after each real request
(:class:`agentkv.testing.ScriptedReplies`). Each framework's conversation grows past fast's window with a warm fired
on the way: no request fast receives overflows its window, the escalated call runs on slow and reads >= 0.95 of the
warm's full blocks (slow's own ``cached_tokens``), warm and escalation carry the tenant's salt, and litellm's
callbacks see each call once.
"""

import asyncio
import copy
import json
import threading
import uuid

import pytest

from agentkv import Backend, Conversations, Session, derive_cache_salt
from agentkv.demo.script import TOOLS, ScriptedAgent
from agentkv.testing import ScriptedReplies
from agent_checks import escalated_request, the_warm, tokenize
from conftest import chat_requests

TOOLS8 = TOOLS[:8]
SECRET = "provider-secret"
STEPS = 14
ROWS = "host {i:03d} sdb latency p99 {ms} ms, queue depth {q}, compaction backlog {b} GiB, firmware 2.1.{i}\n"
_GLOBAL_LISTS = ("callbacks", "input_callback", "success_callback", "failure_callback",
                 "_async_success_callback", "_async_failure_callback", "service_callback", "custom_provider_map")


def lookup_text(topic: str) -> str:
    """A tool result of about 150 tokens."""
    return f"results for {topic}:\n" + "".join(ROWS.format(i=i, ms=40 + i, q=i % 7, b=i * 3) for i in range(6))


@pytest.fixture
def litellm_mod():
    """litellm with a counting logger; its global callback lists and providers restored after the test."""
    from agentkv._support.env import import_litellm

    litellm = import_litellm()
    saved = {name: list(getattr(litellm, name)) for name in _GLOBAL_LISTS if hasattr(litellm, name)}
    yield litellm
    for name, value in saved.items():
        setattr(litellm, name, value)


@pytest.fixture
def events(litellm_mod):
    """A CustomLogger counting litellm's events: the call each fired for and its response (or error)."""
    from litellm.integrations.custom_logger import CustomLogger

    class Counting(CustomLogger):
        def __init__(self):
            super().__init__()
            self.seen, self.changed = [], threading.Condition()

        def _add(self, kind, kwargs, obj=None):
            with self.changed:
                self.seen.append((kind, kwargs.get("model"), kwargs.get("response_cost"), obj))
                self.changed.notify_all()

        def log_pre_api_call(self, model, messages, kwargs):
            self._add("pre", kwargs)

        def log_success_event(self, kwargs, response_obj, start_time, end_time):
            self._add("success", kwargs, response_obj)

        async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
            self._add("success", kwargs, response_obj)

        def log_failure_event(self, kwargs, response_obj, start_time, end_time):
            self._add("failure", kwargs, kwargs.get("exception"))

        async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
            self._add("failure", kwargs, kwargs.get("exception"))

        def kinds(self, kind):
            return [e for e in self.seen if e[0] == kind]

        def wait(self, finished, timeout_s=10.0):
            """Block until ``finished`` calls succeeded or failed (sync success callbacks run on a thread)."""
            with self.changed:
                return self.changed.wait_for(lambda: len(self.kinds("success")) + len(self.kinds("failure"))
                                             >= finished, timeout_s)

    logger = Counting()
    litellm_mod.callbacks = [logger]
    return logger


def backends(fresh):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return fast, slow


def make_session(fresh, **kwargs):
    return Session(*backends(fresh), discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                   in_flight=fresh["in_flight"], session_id=fresh["session_id"], tenant="acme",
                   cache_salt_secret=SECRET, **kwargs)


def make_conversations(fresh, tenant, **kwargs):
    return Conversations(*backends(fresh), tenant=tenant, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                         in_flight=fresh["in_flight"], cache_salt_secret=SECRET, **kwargs)


def conversation(turns):
    agent = ScriptedAgent(result_rows=1)
    msgs = agent.opening()
    for _ in range(turns):
        msgs += agent.next_turn()
    msgs = copy.deepcopy(msgs)
    msgs[0]["content"] = f"run {uuid.uuid4().hex}\n{msgs[0]['content']}"  # nothing cached from another test
    return msgs


def check_figures(fresh, events, *, tenant):
    """What every framework's run must show, from the servers' side and litellm's: returns the figures as reported."""
    fast, slow = fresh["fast"], fresh["slow"]
    fast_bodies = chat_requests(fast)
    assert all(len(tokenize(fast, body)) < fast.max_model_len for body in fast_bodies)  # no overflow reaches fast
    warm, escalation = the_warm(slow), escalated_request(slow)
    salt = derive_cache_salt(SECRET, tenant)
    assert warm["cache_salt"] == escalation["cache_salt"] == salt
    assert all(body["cache_salt"] == salt for body in fast_bodies)
    sent = len(fast_bodies) + len([b for b in chat_requests(slow) if b.get("max_tokens") != 1])
    assert events.wait(sent)
    answers = [obj for kind, _, _, obj in events.kinds("success")]
    assert len(answers) == sent and events.kinds("failure") == []  # once per call: not again for the inner call
    assert len(events.kinds("pre")) == sent
    escalated = next(a for a in answers if a.model == slow.model_id)  # the backend's own ModelResponse
    block = slow.engine.prefix_cache.block_size
    warmed = len(tokenize(slow, warm))
    full = warmed // block * block
    cached = escalated.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.95 * full, (cached, full)
    return f"{cached} cached / {warmed} warmed ({full} in full blocks)"


# ----------------------------------------------------------------------------- plain litellm calls


def test_every_form_of_call_runs_through_the_session_and_is_logged_once(fresh, litellm_mod, events):
    """completion, acompletion and both streams run through the Session: its ledger has a row each, the answer is the
    backend's own (usage, cached tokens), a stream ends with the backend's usage, and litellm logs each call once,
    priced as the backend (streams too)."""
    from agentkv.integrations.litellm import register

    litellm_mod.register_model({f"hosted_vllm/{fresh['fast'].model_id}": {
        "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6, "litellm_provider": "hosted_vllm",
        "mode": "chat"}})
    msgs = conversation(1)
    with make_session(fresh) as session:
        register("agentkv", session)
        call = {"model": "agentkv/fast", "messages": msgs, "tools": TOOLS8, "max_tokens": 4}
        first = litellm_mod.completion(**call)
        chunks = list(litellm_mod.completion(**call, stream=True, stream_options={"include_usage": True}))

        async def both():
            answer = await litellm_mod.acompletion(**call)
            stream = await litellm_mod.acompletion(**call, stream=True, stream_options={"include_usage": True})
            return answer, [chunk async for chunk in stream]

        second, achunks = asyncio.run(both())
    assert first.model == second.model == fresh["fast"].model_id and first.usage.prompt_tokens > 800
    assert second.usage.prompt_tokens_details.cached_tokens > 0.8 * second.usage.prompt_tokens
    for streamed in (chunks, achunks):
        assert streamed[-1].usage.prompt_tokens == first.usage.prompt_tokens  # the backend's figure, not litellm's
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0.8 * first.usage.prompt_tokens
    assert [row.backend for row in session.ledger] == ["fast"] * 4
    assert [row.cached_tokens for row in session.ledger][1:] == [c.usage.prompt_tokens_details.cached_tokens for c in
                                                                 (chunks[-1], second, achunks[-1])]
    assert events.wait(4) and len(events.kinds("success")) == 4 and len(events.kinds("pre")) == 4
    assert all(model == "fast" for _, model, _, _ in events.kinds("success"))  # the caller's call, not the inner one
    usages = [first.usage, chunks[-1].usage, second.usage, achunks[-1].usage]
    costs = sorted(usage.prompt_tokens * 1e-6 + usage.completion_tokens * 2e-6 for usage in usages)
    assert sorted(cost for _, _, cost, _ in events.kinds("success")) == pytest.approx(costs)  # the backend's price


def test_errors_are_litellms_mapped_exceptions(fresh, litellm_mod, events):
    """A request no backend holds is a ContextWindowExceededError (400), a malformed one a BadRequestError (400), in
    sync, async and streamed calls; litellm's failure callbacks fire once per call, and nothing reaches a server."""
    from agentkv.integrations.litellm import register

    too_long = conversation(1) * 100
    malformed = [{"role": 3, "content": "role not a string"}]
    with make_session(fresh) as session:
        register("agentkv", session)

        def call(messages, **kwargs):
            return litellm_mod.completion(model="agentkv/fast", messages=messages, max_tokens=4, **kwargs)

        with pytest.raises(litellm_mod.ContextWindowExceededError) as overflow:
            call(too_long)
        with pytest.raises(litellm_mod.ContextWindowExceededError):
            call(too_long, stream=True)
        with pytest.raises(litellm_mod.BadRequestError) as bad:
            call(malformed)

        async def streamed():
            stream = await litellm_mod.acompletion(model="agentkv/fast", messages=too_long, max_tokens=4, stream=True)
            return [chunk async for chunk in stream]

        with pytest.raises(litellm_mod.ContextWindowExceededError):
            asyncio.run(streamed())
        with pytest.raises(litellm_mod.ContextWindowExceededError):
            asyncio.run(litellm_mod.acompletion(model="agentkv/fast", messages=too_long, max_tokens=4))
    assert overflow.value.status_code == 400 and bad.value.status_code == 400
    assert not isinstance(bad.value, litellm_mod.ContextWindowExceededError)
    assert chat_requests(fresh["fast"]) == chat_requests(fresh["slow"]) == []
    assert events.wait(5) and len(events.kinds("failure")) == 5 and events.kinds("success") == []


def test_agentkv_errors_become_litellms_with_their_status(litellm_mod):
    """Each error agentkv raises before or instead of a backend's answer is litellm's mapped exception."""
    from agentkv.errors import AnswerTooLarge, ContextOverflowError, InvalidRequestError, PoolExhaustedError
    from agentkv.integrations.litellm import litellm_errors

    cases = [(ContextOverflowError("too long", input_tokens=9, windows={"fast": 4}),
              litellm_mod.ContextWindowExceededError, 400),
             (InvalidRequestError("messages[0].role is missing", index=0, field="role"), litellm_mod.BadRequestError, 400),
             (PoolExhaustedError("slow", {"http://h1/v1": "refused"}), litellm_mod.ServiceUnavailableError, 503),
             (AnswerTooLarge(1024), litellm_mod.APIError, 502)]
    for error, mapped, status in cases:
        with pytest.raises(mapped) as raised, litellm_errors("fast", "agentkv"):
            raise error
        assert raised.value.status_code == status and raised.value.__cause__ is error
    backend_error = litellm_mod.RateLimitError("slow down", "m", "hosted_vllm")
    with pytest.raises(litellm_mod.RateLimitError) as raised, litellm_errors("fast", "agentkv"):
        raise backend_error
    assert raised.value is backend_error  # a backend's own error passes as it is


def test_the_conversation_is_named_by_metadata_or_user_else_its_opening(fresh, litellm_mod, events):
    """With a Conversations: metadata's session_id/thread_id or the call's user names the conversation (its Session
    kept when the message list is rebuilt); without one, the opening's fingerprint does."""
    from agentkv.integrations.litellm import register

    msgs = conversation(1)
    with make_conversations(fresh, "acme") as convs:
        register("agentkv", convs)

        def ask(messages, **kwargs):
            litellm_mod.completion(model="agentkv/fast", messages=messages, max_tokens=2, **kwargs)

        ask(msgs, metadata={"session_id": "chat-1"})
        ask(conversation(0), metadata={"session_id": "chat-1"})  # a rebuilt history: the same conversation
        ask(msgs, metadata={"thread_id": "thread-9"})
        ask(msgs, user="user-7")
        ask(msgs)
        ask(msgs + [{"role": "user", "content": "and then?"}])  # the same opening: the same conversation
        held = convs.stats()["sessions"]
    assert sorted(one["requests_total"] for one in held.values()) == [1, 1, 2, 2] and events.wait(6)


def test_tenant_of_is_handed_the_calls_api_key(fresh, litellm_mod, events):
    """A Conversations' tenant_of reads the call (its api_key here, as the gateway does): each key's conversation is
    salted for its own tenant, whatever the call's metadata says."""
    from agentkv.integrations.litellm import register

    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    fast, slow = backends(fresh)
    with Conversations(fast, slow, tenant_of=lambda call: keys[call["api_key"]], discovery=fresh["discovery"],
                       cooldowns=fresh["cooldowns"], in_flight=fresh["in_flight"], cache_salt_secret=SECRET) as convs:
        register("agentkv", convs)
        for key in keys:
            litellm_mod.completion(model="agentkv/fast", messages=conversation(0), max_tokens=2, api_key=key,
                                   metadata={"session_id": "chat-1", "tenant": "tenant-a"})
        held = convs.stats()["sessions"]
    assert sorted(held) == ["tenant-a/h:chat-1", "tenant-b/h:chat-1"]
    assert [body["cache_salt"] for body in chat_requests(fresh["fast"])] == [derive_cache_salt(SECRET, t)
                                                                            for t in keys.values()]


def test_a_factory_is_called_once_and_an_unknown_name_is_refused(fresh, litellm_mod, events):
    """A callable target is built on the first call and kept; a name of litellm's own providers is refused."""
    from agentkv.integrations.litellm import register, unregister

    built = []

    def factory():
        built.append(make_session(fresh))
        return built[-1]

    register("agentkv", factory)
    for _ in range(2):
        litellm_mod.completion(model="agentkv/fast", messages=conversation(0), max_tokens=2)
    assert len(built) == 1 and len(built[0].ledger) == 2
    unregister("agentkv")
    assert all(item["provider"] != "agentkv" for item in litellm_mod.custom_provider_map)
    for name in ("openai", "hosted_vllm", "a/b", ""):
        with pytest.raises(ValueError):
            register(name, built[0])


# ----------------------------------------------------------------------------- frameworks


def script(final):
    """Tool calls for STEPS turns, then ``final``."""
    return [[("lookup", json.dumps({"topic": f"disk-{i}"}))] for i in range(STEPS)] + [final]


def test_smolagents_tool_calling_agent_through_the_provider(fresh, litellm_mod, events):
    """smolagents' LiteLLMModel(model_id="agentkv/fast") in a ToolCallingAgent, served by a Conversations (the
    opening names the conversation): the run escalates to slow after a warm, as the servers report."""
    from smolagents import LiteLLMModel, ToolCallingAgent, tool

    from agentkv.integrations.litellm import register

    @tool
    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic.

        Args:
            topic: what to look up.
        """
        return lookup_text(topic)

    replies = ScriptedReplies(script([("final_answer", json.dumps({"answer": "It was compaction."}))]))
    with make_conversations(fresh, "acme", client=replies) as convs:
        register("agentkv", convs)
        agent = ToolCallingAgent(tools=[lookup], model=LiteLLMModel(model_id="agentkv/fast", max_tokens=8),
                                 max_steps=STEPS + 2, verbosity_level=0,
                                 instructions=f"Investigate the fleet. Run {uuid.uuid4().hex}.")
        answer = agent.run("Why the latency?")
        assert convs.drain_warms(30)
        stats = convs.stats()
    assert answer == "It was compaction." and stats["conversations"] == 1  # one run: found by its opening
    totals = stats["totals"]
    assert totals["warm_fired"] == 1 and totals["escalations_after_warm"] == 1 and totals["overflow_errors"] == 0
    assert totals["requests_total"] == STEPS + 1
    print("smolagents", check_figures(fresh, events, tenant="acme"))


def test_google_adk_llm_agent_through_the_provider(fresh, litellm_mod, events):
    """Google ADK's LiteLlm(model="agentkv/fast") in an LlmAgent with a tool, run by its InMemoryRunner (nothing
    reaches Google): the run escalates to slow after a warm, as the servers report."""
    from google.adk.agents import LlmAgent
    from google.adk.models.lite_llm import LiteLlm
    from google.adk.runners import InMemoryRunner
    from google.genai import types

    from agentkv.integrations.litellm import register

    def lookup(topic: str) -> str:
        """Look up the fleet's records about a topic."""
        return lookup_text(topic)

    async def run(convs):
        agent = LlmAgent(name="sre", model=LiteLlm(model="agentkv/fast", max_tokens=8), tools=[lookup],
                         instruction=f"Investigate the fleet. Run {uuid.uuid4().hex}.")
        runner = InMemoryRunner(agent=agent, app_name="sre")
        session = await runner.session_service.create_session(app_name="sre", user_id="u")
        message = types.Content(role="user", parts=[types.Part(text="Why the latency?")])
        texts = [part.text async for event in runner.run_async(user_id="u", session_id=session.id,
                                                               new_message=message)
                 for part in (event.content.parts if event.content else []) if part.text]
        await convs.adrain_warms(30)
        return texts

    replies = ScriptedReplies(script("It was compaction."))
    with make_conversations(fresh, "globex", client=replies) as convs:
        register("agentkv", convs)
        texts = asyncio.run(run(convs))
        stats = convs.stats()
    assert texts[-1] == "It was compaction." and stats["conversations"] == 1
    totals = stats["totals"]
    assert totals["warm_fired"] == 1 and totals["escalations_after_warm"] == 1 and totals["overflow_errors"] == 0
    assert totals["requests_total"] == STEPS + 1
    print("google-adk", check_figures(fresh, events, tenant="globex"))
