"""@agentkv.session: a Session per call in a context variable, for functions, coroutines and generators."""

import asyncio
import inspect

import pytest

from agentkv import Backend, ConfigurationError
from agentkv.decorator import NoSessionError, acompletion, completion, configure, current_session, session
from conftest import chat_requests

FAST = Backend("hosted_vllm/offline-fast", window=8192, name="fast")
SLOW = Backend("hosted_vllm/offline-slow", window=32768, name="slow")


class EchoClient:
    """A litellm-shaped client that records each request and answers with the model it was sent to."""

    def __init__(self):
        self.requests = []

    def completion(self, **kwargs):
        self.requests.append(kwargs)
        return {"choices": [{"message": {"role": "assistant", "content": kwargs["model"]}}]}

    async def acompletion(self, **kwargs):
        return self.completion(**kwargs)


HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client():
    """A fresh echo client."""
    return EchoClient()


@pytest.fixture
def defaults(client):
    """Module defaults for the bare decorator (offline backends), restored afterwards."""
    previous = configure(fast=FAST, slow=SLOW, client=client)
    yield client
    configure(**previous)


def test_bare_decorator_without_defaults_names_what_is_missing():
    """With nothing configured, calling a bare-decorated function raises ConfigurationError naming fast and configure()."""
    previous = configure()

    @session
    def loop():
        return current_session()

    try:
        with pytest.raises(ConfigurationError, match=r"no fast backend.*configure\(fast="):
            loop()
    finally:
        configure(**previous)


def test_bare_decorator_uses_configured_defaults_and_a_session_per_call(defaults):
    """Each call gets its own Session from configure()'s defaults, closed when the call returns."""
    @session
    def loop():
        return current_session()

    first, second = loop(), loop()
    assert first.fast == FAST and first.slow == SLOW and first.closed and second.closed
    assert first.session_id != second.session_id and current_session() is None


def test_module_completion_routes_through_the_current_session(defaults):
    """completion() inside the call goes through the Session's routing; outside any call it raises NoSessionError."""
    @session(tenant="acme")
    def loop():
        completion(messages=HI, max_tokens=8)
        return current_session()

    s = loop()
    assert defaults.requests[0]["model"] == FAST.model and s.last_route.backend == "fast" and s.tenant == "acme"
    with pytest.raises(NoSessionError, match="outside an @agentkv.session"):
        completion(messages=HI)


def test_call_keywords_are_taken_and_stripped_unless_declared(defaults):
    """session_id and tenant are read from the call; removed unless the function names them, then passed too."""
    @session(tenant="decorator")
    def strips(x, **kwargs):
        return x, kwargs, current_session()

    @session
    def declares(x, tenant=None):
        return tenant, current_session()

    x, kwargs, s = strips(1, session_id="chat-42", tenant="caller", other=2)
    assert (x, kwargs, s.session_id, s.tenant) == (1, {"other": 2}, "chat-42", "caller")
    tenant, s2 = declares(1, "positional")
    assert tenant == "positional" and s2.tenant == "positional"
    assert declares(1)[1].tenant is None


def test_signature_and_kinds_are_preserved():
    """functools.wraps metadata, the signature and the coroutine/generator kind survive decoration."""
    def f(a: int, *, b: str = "x") -> int:
        """Doc."""
        return a

    async def c(a: int) -> int:
        return a

    def g(n: int):
        yield n

    async def ag(n: int):
        yield n

    for func in (f, c, g, ag):
        wrapped = session(fast=FAST)(func)
        assert wrapped.__name__ == func.__name__ and wrapped.__doc__ == func.__doc__ and wrapped.__wrapped__ is func
        assert inspect.signature(wrapped) == inspect.signature(func)
        for check in (inspect.iscoroutinefunction, inspect.isgeneratorfunction, inspect.isasyncgenfunction):
            assert check(wrapped) == check(func)


def test_unknown_session_keyword_fails_at_decoration():
    """A keyword Session does not take is refused when decorating, not on the first call."""
    with pytest.raises(ConfigurationError, match="fasst"):
        session(fasst=FAST)


def test_nested_calls_reuse_the_outer_session_unless_told_otherwise(defaults):
    """An inner decorated call reuses the outer Session; new=True or another tenant gets its own, closed on return."""
    @session
    def inner():
        return current_session()

    @session(new=True)
    def isolated():
        return current_session()

    @session
    def outer():
        here = current_session()
        return here, inner(), isolated(), inner(tenant="other"), here.closed

    here, reused, own, other, closed_inside = outer()
    assert reused is here and not closed_inside and here.closed
    assert own is not here and own.closed and other is not here and other.tenant == "other"


def test_session_is_closed_when_the_call_raises(defaults):
    """An exception leaves no Session current and the call's Session closed."""
    seen = []

    @session
    def fails():
        seen.append(current_session())
        raise KeyError("boom")

    with pytest.raises(KeyError):
        fails()
    assert seen[0].closed and current_session() is None


async def test_gather_tasks_each_see_their_own_session(defaults):
    """Concurrent decorated coroutines under asyncio.gather keep their own Session across awaits."""
    @session
    async def agent(name):
        mine = current_session()
        await asyncio.sleep(0.01)
        await acompletion(messages=[{"role": "user", "content": name}])
        await asyncio.sleep(0.01)
        return name, mine, current_session()

    results = await asyncio.gather(*(agent(n) for n in ("a", "b", "c")))
    assert all(before is after for _, before, after in results)
    assert len({id(s) for _, s, _ in results}) == 3 and all(s.closed for _, s, _ in results)


async def test_to_thread_carries_the_session(defaults):
    """asyncio.to_thread copies the context, so a sync helper in a thread routes through the caller's Session."""
    def blocking_step():
        completion(messages=HI)
        return current_session()

    @session
    async def agent():
        return current_session(), await asyncio.to_thread(blocking_step)

    mine, in_thread = await agent()
    assert in_thread is mine and len(defaults.requests) == 1


def test_generator_session_lives_for_its_steps_only(defaults):
    """A generator's Session opens at the first step, is hidden from the caller between steps, and closes at the end."""
    @session
    def steps(n):
        for i in range(n):
            received = yield i, current_session()
            assert received in (None, "ping")
        return "done"

    gen = steps(2)
    _, s = next(gen)
    assert current_session() is None and not s.closed
    assert gen.send("ping")[1] is s
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "done" and s.closed


def test_generator_close_and_throw_reach_the_inner_generator(defaults):
    """close() and throw() pass through to the wrapped generator, and its Session is closed either way."""
    log = []

    @session
    def worker():
        try:
            while True:
                try:
                    yield current_session()
                except ValueError:
                    log.append(("caught", current_session() is not None))
        finally:
            log.append(("finally", current_session() is not None))

    gen = worker()
    s = next(gen)
    assert gen.throw(ValueError("x")) is s
    gen.close()
    assert log == [("caught", True), ("finally", True)] and s.closed


async def test_async_generator_session_lives_for_its_steps_only(defaults):
    """An async generator gets the same scoping: its Session during its steps only, closed by aclose()."""
    @session
    async def stream(n):
        for _ in range(n):
            await asyncio.sleep(0)
            await acompletion(messages=HI)
            yield current_session()

    agen = stream(3)
    s = await agen.__anext__()
    assert current_session() is None and await agen.__anext__() is s
    await agen.aclose()
    assert s.closed and len(defaults.requests) == 2


def test_against_the_embedded_server(fresh):
    """A decorated loop's module-level completion() reaches the embedded fast server through litellm."""
    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")

    @session(fast=fast, discovery=fresh["discovery"])
    def loop():
        resp = completion(messages=HI, max_tokens=2)
        return resp, current_session()

    resp, s = loop()
    assert resp.choices and s.last_route.window == 2048 and len(chat_requests(fresh["fast"])) == 1


async def test_a_warm_fired_in_a_coroutine_outlives_the_call(fresh):
    """Closing a decorated coroutine's Session leaves its async warm-ahead running to the slow server."""
    from agentkv.demo.script import TOOLS, ScriptedAgent

    fast = Backend(f"hosted_vllm/{fresh['fast'].model_id}", api_base=fresh["fast"].api_base, name="fast")
    slow = Backend(f"hosted_vllm/{fresh['slow'].model_id}", api_base=fresh["slow"].api_base, name="slow")
    agent = ScriptedAgent(result_rows=1)
    msgs = agent.opening() + [m for _ in range(4) for m in agent.next_turn()]

    @session(fast=fast, slow=slow, discovery=fresh["discovery"], cooldowns=fresh["cooldowns"],
             in_flight=fresh["in_flight"])
    async def turn():  # observe fires the warm as a task and returns at once, before it ran
        await current_session().aobserve(messages=msgs, tools=TOOLS[:8], max_tokens=2)
        return current_session()

    s = await turn()
    assert s.closed and s.stats()["warm_fired"] == 1
    await s.adrain_warms(30)
    assert s.stats()["warm_completed"] == 1
    assert [b["max_tokens"] for b in chat_requests(fresh["slow"])] == [1]


def test_importing_the_integration_cores_stays_cheap():
    """The decorator, the ReAct helper and toolschema import no litellm, torch, transformers or LangChain."""
    import subprocess
    import sys

    code = ("import sys, agentkv.decorator, agentkv.react, agentkv.toolschema; "
            "print([m for m in ('litellm', 'torch', 'transformers', 'langchain_core') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
