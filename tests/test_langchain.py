"""The LangChain callback handlers and router, with real langchain-core fake chat models and the embedded servers."""

import copy
import uuid

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, convert_to_messages, convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentkv import Backend, ContextOverflowError, Session
from agentkv.integrations.langchain import (
    AgentKVCallbackHandler,
    AgentKVRouter,
    ChatAgentKV,
    AsyncAgentKVCallbackHandler,
    chat_request,
)
from agentkv.demo.script import TOOLS, ScriptedAgent
from conftest import chat_requests

TOOLS8 = TOOLS[:8]


class ToolChatModel(FakeMessagesListChatModel):
    """A fake chat model with the usual bind_tools: tools bound as OpenAI schemas."""

    def bind_tools(self, tools, **kwargs):
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)


class BadRequestError(Exception):
    """Shaped like an OpenAI/litellm 400: a status code and the server's message."""

    status_code = 400


class FailingChatModel(ToolChatModel):
    """A chat model whose every call fails with ``error``."""

    error: str = ""

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        raise BadRequestError(self.error)


def answer(text="ok", cache_read=None):
    """An AIMessage, with usage metadata when ``cache_read`` is given."""
    if cache_read is None:
        return AIMessage(content=text)
    return AIMessage(content=text, usage_metadata={"input_tokens": 10, "output_tokens": 1, "total_tokens": 11,
                                                   "input_token_details": {"cache_read": cache_read}})


def model(*responses):
    """A tool-capable fake model answering ``responses`` in turn, with the scripted agent's tools bound."""
    return ToolChatModel(responses=list(responses) or [answer()]).bind_tools(TOOLS8)


def make_session(fresh, **kwargs):
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    return Session(fast, slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
                   in_flight=fresh["in_flight"], session_id=fresh["session_id"], **kwargs)


def history(turns):
    """The scripted agent's conversation after ``turns`` tool turns, as LangChain messages."""
    agent = ScriptedAgent(result_rows=1)
    msgs = agent.opening()
    for _ in range(turns):
        msgs += agent.next_turn()
    return convert_to_messages(copy.deepcopy(msgs))


def test_handlers_are_real_langchain_handlers(fresh):
    """The sync handler is a BaseCallbackHandler and the async one an AsyncCallbackHandler; blocking sets raise_error."""
    s = make_session(fresh)
    assert isinstance(AgentKVCallbackHandler(s), BaseCallbackHandler)
    assert isinstance(AsyncAgentKVCallbackHandler(s), AsyncCallbackHandler)
    assert AgentKVCallbackHandler(s, block_overflow=True).raise_error and not AgentKVCallbackHandler(s).raise_error


def test_accounted_tokens_equal_the_sessions_count(fresh):
    """A call's ledger row holds exactly the Session's count of the converted messages plus the bound tools."""
    msgs = history(2)
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s)
        model().invoke(msgs, config={"callbacks": [handler]})
        expected = s.count(messages=convert_to_openai_messages(msgs), tools=[convert_to_openai_tool(t) for t in TOOLS8])
    row = s.ledger[-1]
    assert (row.input_tokens, row.tool_tokens, row.count_source) == (expected.total, expected.tools, "server")
    assert row.reason == "observed" and row.tool_tokens > 0 and handler.counters["observed"] == 1
    assert chat_requests(fresh["fast"]) == []  # observed, never sent by agentkv


def test_crossing_the_threshold_fires_a_warm_at_the_slow_server(fresh):
    """Once the observed conversation crosses 60% of the fast window, one warm with its messages and tools reaches slow."""
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s)
        chat = model()
        for turns in range(7):
            msgs = history(turns)
            chat.invoke(msgs, config={"callbacks": [handler]})
            if s.stats()["warm_fired"]:
                break
        assert s.drain_warms(30)
    warms = [b for b in chat_requests(fresh["slow"]) if b.get("max_tokens") == 1]
    assert len(warms) == 1 and s.ledger[-1].warm == "fire" and s.ledger[-1].input_tokens >= 0.6 * 2048
    assert warms[0]["messages"] == convert_to_openai_messages(msgs) and warms[0]["tools"] == TOOLS8


def test_block_overflow_stops_the_call_before_it_is_sent(fresh):
    """A call over the fast window raises ContextOverflowError naming window, count and slow; the model never runs."""
    chat = ToolChatModel(responses=[answer("never")])
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s, block_overflow=True)
        with pytest.raises(ContextOverflowError, match=r"do not fit 'fast' \(window 2048\).*send it to 'slow'") as err:
            chat.bind_tools(TOOLS8).invoke(history(12), config={"callbacks": [handler]})
        assert s.drain_warms(30)
    assert err.value.suggested_backend == "slow" and err.value.windows == {"fast": 2048, "slow": 16384}
    assert err.value.input_tokens == s.ledger[-1].input_tokens > 2048 and chat_requests(fresh["fast"]) == []
    assert chat.i == 0 and handler.counters["blocked"] == 1 and handler.runs == {}


def test_without_blocking_an_overflowing_call_is_only_counted(fresh):
    """With block_overflow off, the same call goes through and is recorded in the ledger."""
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s)
        reply = model(answer("went through")).invoke(history(12), config={"callbacks": [handler]})
        assert s.drain_warms(30)
    assert reply.content == "went through" and s.ledger[-1].input_tokens > 2048
    assert handler.counters["blocked"] == 0 and handler.counters["observed"] == 1


def test_usage_metadata_cache_reads_are_recorded(fresh):
    """on_llm_end puts usage_metadata's cache_read into the call's ledger row and the Session's stats."""
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s)
        model(answer(cache_read=96)).invoke(history(1), config={"callbacks": [handler]})
    assert s.ledger[-1].cached_tokens == 96 and s.stats()["cached_tokens_total"] == 96
    assert handler.counters["usage_recorded"] == 1 and handler.runs == {}


def test_run_ids_are_tracked_by_the_full_uuid(fresh):
    """Two UUIDv7 runs sharing a long prefix, ending out of order, each record usage on their own ledger turn."""
    base = uuid.uuid7() if hasattr(uuid, "uuid7") else uuid.UUID("01a22ada-28f1-72a9-8c48-40ff87a6c75f")
    first, second = uuid.UUID(int=base.int), uuid.UUID(int=base.int + 1)
    assert str(first)[:30] == str(second)[:30]
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s)
        for run_id, turns in ((first, 1), (second, 2)):
            handler.on_chat_model_start({}, [history(turns)], run_id=run_id, invocation_params={"tools": TOOLS8})
        for run_id, cached in ((second, 22), (first, 11)):
            handler.on_llm_end(LLMResult(generations=[[ChatGeneration(message=answer(cache_read=cached))]]),
                               run_id=run_id)
        handler.on_llm_end(LLMResult(generations=[[ChatGeneration(message=answer(cache_read=5))]]), run_id=first)
    assert [row.cached_tokens for row in s.ledger] == [11, 22]
    assert handler.counters["unknown_runs"] == 1 and handler.runs == {}


def test_overflow_errors_are_recognised_and_counted(fresh):
    """A failing call is counted as an overflow when its error is a context-overflow 400, else as another error."""
    overflow = ("This model's maximum context length is 2048 tokens. However, you requested 4096 tokens "
                "(3000 in the messages, 1096 in the completion).")
    with make_session(fresh) as s:
        handler = AgentKVCallbackHandler(s)
        for error in (overflow, "rate limited"):
            with pytest.raises(BadRequestError):
                FailingChatModel(responses=[answer()], error=error).invoke(history(0), config={"callbacks": [handler]})
    assert handler.counters["overflow_errors"] == 1 and handler.counters["other_errors"] == 1 and handler.runs == {}


async def test_async_handler_observes_records_and_blocks(fresh):
    """Under ainvoke the async twin accounts the call, records cache reads and blocks an overflowing call."""
    async with make_session(fresh, count_exactly=True) as s:
        handler = AsyncAgentKVCallbackHandler(s, block_overflow=True)
        await model(answer(cache_read=32)).ainvoke(history(1), config={"callbacks": [handler]})
        with pytest.raises(ContextOverflowError, match="send it to 'slow'"):
            await model().ainvoke(history(12), config={"callbacks": [handler]})
        await s.adrain_warms(30)
    expected = s.count(messages=convert_to_openai_messages(history(1)), tools=TOOLS8).total
    assert s.ledger[0].input_tokens == expected and s.ledger[0].cached_tokens == 32
    assert handler.counters == {**handler.counters, "observed": 2, "blocked": 1, "usage_recorded": 1}


def test_router_sends_what_fast_cannot_hold_to_the_slow_model(fresh):
    """AgentKVRouter answers from the fast model while the conversation fits and from the slow model once it does not."""
    fast_model = ToolChatModel(responses=[answer("fast", cache_read=3)])
    slow_model = ToolChatModel(responses=[answer("slow")])
    with make_session(fresh) as s:
        router = AgentKVRouter(fast_model, slow_model, s).bind_tools(TOOLS8)
        short, long = router.invoke(history(1)), router.invoke(history(12))
        assert s.drain_warms(30)
    assert (short.content, long.content) == ("fast", "slow") and router.last_role == "slow"
    assert [row.reason for row in s.ledger] == ["fits", "proactive"] and s.ledger[0].cached_tokens == 3
    assert [row.backend for row in s.ledger] == ["fast", "slow"] and s.ledger[1].warm == "routed_slow"
    assert s.stats()["escalations"] == 1 and s.stats()["requests"] == {"fast": 1, "slow": 1}
    assert s.ledger[0].tool_tokens > 0 and chat_request(history(1), {"tools": TOOLS8})["tools"] == TOOLS8


async def test_router_async_twin(fresh):
    """The router's ainvoke routes the same way through aobserve; tools bound to the fast model are counted."""
    async with make_session(fresh) as s:
        router = AgentKVRouter(ToolChatModel(responses=[answer("fast")]), ToolChatModel(responses=[answer("slow")]), s)
        assert (await router.ainvoke(history(14))).content == "slow"
        assert (await router.ainvoke("hello")).content == "fast"
        assert AgentKVRouter(model(), model(), s).tools == TOOLS8  # tools already bound to the fast model count
        await s.adrain_warms(30)


def test_chat_agentkv_resends_a_fast_overflow_to_slow_and_salts_chatopenai_style_models(fresh):
    """A context-overflow 400 from the fast model is re-sent to the slow model; the caller gets one answer."""
    overflow = ("This model's maximum context length is 2048 tokens. However, you requested 4196 tokens "
                "(4100 in the messages, 96 in the completion).")
    with make_session(fresh) as s:
        router = ChatAgentKV(FailingChatModel(responses=[answer()], error=overflow),
                             ToolChatModel(responses=[answer("slow")]), s)
        assert router.invoke(history(1)).content == "slow" and router.last_role == "slow"
        assert s.drain_warms(30)
    assert s.stats()["overflow_errors"] >= 1 and s.stats()["reactive_escalations"] == 1
    assert [row.backend for row in s.ledger] == ["slow"] and s.stats()["escalations"] == 1
