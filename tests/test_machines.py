"""The effect drivers and the machines they run, where sync and async differ: a cancellation runs a machine's
cleanup, a sync call spawns on a thread even inside an event loop, and what a cancelled lookup or warm held is given
back; a turn whose escalation is refused ends with that error; a prepared request's body and its stream's usage."""

import asyncio
import threading
import time

import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv._support.effects import Call, Spawn, arun, run
from agentkv._support.jobs import BackgroundJobs
from agentkv.state.memory import InProcessStore
from agentkv.stats import SessionStats
from agentkv.testing import FakeHttp, models_answer
from agentkv.tokens import Payload
from agentkv.warm import WarmAheadPolicy
from agentkv.warm.sender import Claimed, WarmAhead, WarmPlan, WarmRequest
from agentkv.wire.openai import Rejected

FAST = Backend("hosted_vllm/fast-m", api_base="http://127.0.0.1:9/v1", name="fast", window=4096)
SLOW = Backend("hosted_vllm/slow-m", api_base="http://127.0.0.1:8/v1", name="slow", window=8192)


def test_a_cancelled_machine_runs_its_cleanup_and_what_the_cleanup_yields():
    """A task's timeout is thrown into the machine at its yield: its ``finally`` runs, the call it yields there is
    carried out, and the cancellation goes on."""
    done = []

    async def hang():
        await asyncio.sleep(30)

    async def note(what):
        done.append(what)

    def machine():
        try:
            yield Call(lambda: None, hang)
        finally:
            yield Call(lambda what: None, note, ("released",))

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(arun(machine()), 0.05)

    asyncio.run(main())
    assert done == ["released"]


def test_the_sync_driver_spawns_on_a_thread_inside_a_running_loop():
    """A sync call made inside a coroutine never yields to its loop: what it spawns runs on a worker thread at once."""
    ran = threading.Event()

    def job():
        yield Call(ran.set, None)

    def step():
        yield Spawn(job, 1.0)

    async def main():
        jobs = BackgroundJobs()
        run(step(), jobs)
        return ran.wait(2.0)  # blocks the loop: only a thread can set it

    assert asyncio.run(main())


def test_a_cancelled_window_lookup_leaves_no_flight_behind():
    """A client that leaves while ``/models`` is in flight: the next lookup asks the server again at once."""
    http = FakeHttp(lambda method, url, body: models_answer("m", 4096), latency_s=1.0)
    discovery = WindowDiscovery(http=http)
    backend = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", name="fast")

    async def main():
        task = asyncio.ensure_future(discovery.awindow(backend))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task])
        http.latency_s = 0.0
        started = time.monotonic()
        info = await discovery.awindow(backend)
        return info, time.monotonic() - started

    info, took = asyncio.run(main())
    assert info.window == 4096 and info.source == "server" and took < 0.5


class _Residency:
    settle_s = 0.0

    def __init__(self):
        self.busy = threading.Lock()
        self.counter = self

    def ids(self, payload, *, add_generation_prompt=True):
        yield from ()
        return [1, 2, 3], True

    def outcome(self, ids, exact, *, claimed, policy):
        return "fire"


class _Hanging:
    def completion(self, **call):
        time.sleep(30)

    async def acompletion(self, **call):
        await asyncio.sleep(30)


@pytest.mark.parametrize("check", [False, True], ids=["plain", "event-aware"])
def test_a_warm_past_its_timeout_gives_its_slot_and_its_check_back(check):
    """A warm task that hits its timeout releases its in-flight slot (and an event-aware one its check), so the
    process's next conversations are not refused as saturated."""
    store, jobs = InProcessStore(), BackgroundJobs()
    tenant = f"timeout-{check}-{time.monotonic_ns()}"  # the cooldowns are the process's
    warm = WarmAhead(WarmAheadPolicy(timeout_s=0.1, max_in_flight=1), store, SessionStats(), session_id="s",
                     tenant=tenant)
    residency = _Residency()
    outcome, lease = store.claim(warm._claim())
    assert outcome == "fire"
    if check:
        residency.busy.acquire()
    claim = Claimed("fire", lease, check=check, claimed=True, owns=check, payload=Payload(({"role": "user",
                                                                                            "content": "hi"},)))
    plan = WarmPlan(claim, WarmRequest(call={"model": "x"}), residency=residency if check else None)

    def spawning():
        yield Spawn(lambda: warm.sending(plan, None, _Hanging()), warm.timeout_s(plan))

    async def main():
        await arun(spawning(), jobs)
        await jobs.adrain(10.0)

    asyncio.run(main())
    other = WarmAhead(WarmAheadPolicy(timeout_s=0.1, max_in_flight=1), store, SessionStats(),
                      session_id="other", tenant=tenant)
    outcome, lease = store.claim(other._claim())
    store.release(lease)
    assert outcome == "fire" and not residency.busy.locked()


def test_a_refused_escalation_ends_the_turn_with_its_error():
    """Fast overflows, its server counts more than slow's window holds: the turn ends (``TurnEnd.error``), it does
    not raise out of ``Session.turn``."""
    http = FakeHttp(lambda method, url, body: (404, {"error": "no"}))
    with Session(FAST, SLOW, http=http, discovery=WindowDiscovery(http=http), cache_salt_secret="k") as s:
        attempt = s.prepare({"model": "fast-m", "messages": [{"role": "user", "content": "hi " * 200}],
                             "max_tokens": 100})
        text = ("This model's maximum context length is 4096 tokens. However, you requested 9100 tokens (9000 in the "
                "messages, 100 in the completion). Please reduce the length of the messages or completion.")

        def send(attempt):
            raise Rejected.of(400, ('{"object":"error","message":"%s","type":"BadRequestError","code":400}'
                                    % text).encode())

        end = s.turn(attempt, send)
    assert type(end.error).__name__ == "ContextOverflowError" and end.answer is None
    assert s.stats()["overflow_errors"] == 1


def test_a_prepared_body_keeps_the_callers_model_on_fast_and_its_stream_is_watched():
    """``prepare`` takes the body as the client sent it: a fast try keeps the client's ``model`` (a LoRA adapter, a
    pinned snapshot), a slow one names slow's; the stream switch rides on the try, and ``answered`` takes the
    stream's usage chunk once it has ended."""
    http = FakeHttp(lambda method, url, body: {"count": 40, "max_model_len": 4096, "tokens": list(range(40))})
    with Session(FAST, SLOW, http=http, discovery=WindowDiscovery(http=http), cache_salt_secret="k",
                 warm_ahead=WarmAheadPolicy(enabled=False)) as s:
        body = {"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        attempt = s.prepare(body)
        assert attempt.decision.role == "fast" and attempt.body["model"] == "sql-lora"
        assert attempt.body["stream"] is True and "stream" not in attempt.kwargs
        assert attempt.url == "http://127.0.0.1:9/v1/chat/completions"
        last = {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                         "prompt_tokens_details": {"cached_tokens": 32}}}
        s.answered(attempt, last)
        assert s.ledger[-1].cached_tokens == 32
