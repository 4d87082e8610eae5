"""Events deferred off a request's path (agentkv.events.defer_events): logged by the loop's next turn, in order,
only in the context that asked, and at once where no loop runs."""

import asyncio
import contextvars

from agentkv.events import defer_events, emit
from agentkv.testing import capture_events


def test_deferred_events_are_logged_at_the_next_turn_in_order_and_only_where_asked():
    """Inside the deferring task nothing is logged until it yields; then every event, in order; another task
    logs at once."""
    async def request():
        defer_events()
        emit("one", n=1)
        emit("two", n=2)
        before = [e["event"] for e in events]
        await asyncio.sleep(0)
        return before

    async def other():
        emit("other")
        return [e["event"] for e in events]

    async def main():
        return await asyncio.gather(asyncio.ensure_future(request()), asyncio.ensure_future(other()))

    with capture_events() as events:
        before, seen_by_other = asyncio.run(main())
    assert before == [] and "other" in seen_by_other
    assert [e["event"] for e in events if e["event"] in ("one", "two")] == ["one", "two"]


def test_without_a_loop_events_are_logged_at_once():
    """Deferring asked for in a thread with no running loop changes nothing."""
    def deferred_here():
        defer_events()
        emit("now")

    with capture_events() as events:
        contextvars.copy_context().run(deferred_here)  # the test's own context is left as it was
    assert [e["event"] for e in events] == ["now"]
