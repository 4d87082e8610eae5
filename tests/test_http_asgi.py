"""The plain-ASGI pieces (agentkv.http.asgi) the gateway and the embedded server share: body limits, replies, and a
client's leaving at each point of the exchange, driven with an ASGI receive/send pair that behaves as uvicorn's does (after the
body, ``receive`` waits until the client disconnects or the response is complete, then says "http.disconnect")."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentkv.http.asgi import BodyTooLarge, ClientLeft, Reply, read_body, serve_exchange, write


class Client:
    """One connection's ASGI pair: the request's body messages, then a disconnect when told (or at the end)."""

    def __init__(self, *bodies: bytes) -> None:
        self.messages = [{"type": "http.request", "body": b, "more_body": i < len(bodies) - 1}
                         for i, b in enumerate(bodies)]
        self.sent: list[dict] = []
        self.gone = asyncio.Event()
        self.received = 0

    async def receive(self) -> dict:
        self.received += 1
        if self.messages:
            return self.messages.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.gone.set()  # uvicorn: once the response is complete, receive() says "http.disconnect"

    def leave(self) -> None:
        self.gone.set()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def scope(**headers: str) -> dict:
    return {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_a_body_arrives_whole_from_its_pieces():
    client = Client(b'{"a"', b": 1}")
    assert asyncio.run(read_body(scope(), client.receive, 100)) == b'{"a": 1}'


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read():
    client = Client(b"x" * 10)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(scope(content_length="101"), client.receive, 100))
    assert client.received == 0


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit():
    client = Client(b"x" * 60, b"x" * 60, b"x" * 60)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(scope(), client.receive, 100))
    assert client.received == 2  # the third piece is never read


def test_a_client_that_leaves_while_sending_its_body_is_noticed():
    client = Client()
    client.messages = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    with pytest.raises(ClientLeft):
        asyncio.run(read_body(scope(), client.receive, 100))


def test_a_whole_reply_is_one_head_and_one_body_with_its_length():
    client = Client()
    asyncio.run(write(client.send, Reply(201, b'{"ok": true}', {"x-agentkv-route": "fits"})))
    start, body = client.sent
    assert start["status"] == 201
    assert dict(start["headers"]) == {b"content-type": b"application/json", b"x-agentkv-route": b"fits",
                                      b"content-length": b"12"}
    assert body == {"type": "http.response.body", "body": b'{"ok": true}'}


def test_an_answer_is_written_and_the_watcher_cancels_nothing_afterwards():
    async def main():
        client = Client(b"{}")
        await read_body(scope(), client.receive, 100)

        async def work():
            await asyncio.sleep(0.01)
            return Reply(200, b"{}")

        reply = await serve_exchange(client.receive, client.send, work())
        await asyncio.sleep(0.01)  # the response is complete: receive() now says "http.disconnect"
        return reply, client

    reply, client = asyncio.run(main())
    assert reply is not None and reply.status == 200 and client.body == b"{}"


def test_a_client_leaving_before_the_answer_cancels_the_work_and_nothing_is_written():
    async def main():
        client = Client(b"{}")
        await read_body(scope(), client.receive, 100)
        cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return Reply(200)

        asyncio.get_running_loop().call_later(0.02, client.leave)
        reply = await asyncio.wait_for(serve_exchange(client.receive, client.send, work()), 5)
        return reply, cancelled.is_set(), client

    reply, cancelled, client = asyncio.run(main())
    assert reply is None and cancelled and client.sent == []


def test_a_client_leaving_mid_stream_closes_the_stream():
    async def main():
        client = Client(b"{}")
        await read_body(scope(), client.receive, 100)
        closed = asyncio.Event()

        async def chunks():
            try:
                yield b"data: 1\n\n"
                client.leave()
                await asyncio.sleep(30)  # the backend is still generating
                yield b"data: 2\n\n"
            finally:
                closed.set()

        async def work():
            return Reply(200, content_type="text/event-stream", chunks=chunks())

        reply = await asyncio.wait_for(serve_exchange(client.receive, client.send, work()), 5)
        return reply, closed.is_set(), client

    reply, closed, client = asyncio.run(main())
    assert reply is None and closed
    assert client.body == b"data: 1\n\n" and all(m.get("more_body") for m in client.sent[1:])


def test_a_stream_ends_with_an_empty_last_body():
    async def main():
        client = Client(b"{}")

        async def chunks():
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"

        async def work():
            return Reply(200, headers={"cache-control": "no-cache"}, content_type="text/event-stream",
                         chunks=chunks())

        await read_body(scope(), client.receive, 100)
        await serve_exchange(client.receive, client.send, work())
        return client

    client = asyncio.run(main())
    assert client.body == b"data: 1\n\ndata: [DONE]\n\n" and client.sent[-1] == {"type": "http.response.body",
                                                                                  "body": b""}
    assert (b"content-length", b"23") not in client.sent[0]["headers"]


def test_the_reply_types_are_plain_json_errors():
    from agentkv.gateway.relay import own_error

    reply = own_error(413, "too big")
    assert reply.status == 413 and reply.headers == {}
    assert json.loads(reply.body)["error"] == {"message": "too big", "type": "invalid_request_error", "param": None,
                                               "code": 413}


def test_a_client_leaving_while_a_chunk_is_being_written_closes_the_stream():
    """The client leaves while a write waits for it (a slow reader): the stream's generator, suspended at its
    yield, is closed all the same (its upstream response closed)."""

    async def main():
        client = Client(b"{}")
        await read_body(scope(), client.receive, 100)
        closed = asyncio.Event()
        sent = client.send

        async def slow_send(message: dict) -> None:
            await sent(message)
            if message.get("more_body"):
                client.leave()
                await asyncio.sleep(30)  # uvicorn's send waits while the client reads nothing

        async def chunks():
            try:
                yield b"data: 1\n\n"
                yield b"data: 2\n\n"
            finally:
                closed.set()

        async def work():
            return Reply(200, content_type="text/event-stream", chunks=chunks())

        reply = await asyncio.wait_for(serve_exchange(client.receive, slow_send, work()), 5)
        return reply, closed.is_set(), client

    reply, closed, client = asyncio.run(main())
    assert reply is None and closed and client.body == b"data: 1\n\n"


def test_a_client_leaving_before_a_stream_begins_still_finishes_it():
    """The client leaves while the head waits to be written (uvicorn's send waits while writing is paused): the
    stream's generator never started, and the reply's finish (closing upstream, recording usage) runs all the
    same."""

    async def main():
        client = Client(b"{}")
        await read_body(scope(), client.receive, 100)
        finished = []

        async def stalled_send(message: dict) -> None:
            client.leave()
            await asyncio.sleep(30)

        async def chunks():
            yield b"data: 1\n\n"

        async def work():
            return Reply(200, content_type="text/event-stream", chunks=chunks(), finish=lambda: finished.append(1))

        reply = await asyncio.wait_for(serve_exchange(client.receive, stalled_send, work()), 5)
        return reply, finished

    reply, finished = asyncio.run(main())
    assert reply is None and finished == [1]


def test_a_finished_stream_is_finished_once():
    async def main():
        client = Client(b"{}")
        finished = []

        async def chunks():
            yield b"data: 1\n\n"

        await read_body(scope(), client.receive, 100)
        await serve_exchange(client.receive, client.send, _reply(chunks(), finished))
        return finished

    assert asyncio.run(main()) == [1]


async def _reply(chunks, finished):
    return Reply(200, content_type="text/event-stream", chunks=chunks, finish=lambda: finished.append(1))


def test_the_routed_posts_are_found_under_a_root_path():
    """Mounted under a root path (uvicorn --root-path, or a proxy's prefix), the routed POSTs are matched on the
    path below it, as Starlette's router matches the other routes."""
    from agentkv.gateway.app import _route_path

    assert _route_path({"path": "/llm/v1/chat/completions", "root_path": "/llm"}) == "/v1/chat/completions"
    assert _route_path({"path": "/v1/completions", "root_path": ""}) == "/v1/completions"
    assert _route_path({"path": "/v1/completions"}) == "/v1/completions"


# ----------------------------------------------------------------------------- BodyLimit: the same limit as middleware

def _limited(app_seen: list, **kwargs):
    from agentkv.http.asgi import BodyLimit

    async def app(scope, receive, send):
        app_seen.append((await receive())["body"])
        await write(send, Reply(200, b"{}"))

    return BodyLimit(app, 100, lambda scope, status: Reply(status, b'{"refused": %d}' % status), **kwargs)


def test_body_limit_hands_its_app_the_body_whole():
    """Within the limit, the app's first receive() is the whole body, in one message."""
    seen: list = []
    client = Client(b'{"a"', b": 1}")
    asyncio.run(_limited(seen)({"type": "http", "headers": []}, client.receive, client.send))
    assert seen == [b'{"a": 1}'] and client.sent[0]["status"] == 200


def test_body_limit_refuses_a_declared_or_a_streamed_body_over_the_limit_without_calling_its_app():
    """413 from ``refuse`` for a declared length over the limit (nothing read) and for a body that grows past it."""
    for client, headers in ((Client(b"x" * 10), scope(content_length="101")["headers"]),
                            (Client(b"x" * 60, b"x" * 60), [])):
        seen: list = []
        asyncio.run(_limited(seen)({"type": "http", "headers": headers}, client.receive, client.send))
        assert seen == [] and client.sent[0]["status"] == 413 and client.body == b'{"refused": 413}'


def test_body_limit_answers_408_to_a_body_not_in_within_its_timeout():
    """A client that sends part of its body and then nothing: ``refuse(scope, 408)`` once ``timeout_s`` has passed."""
    seen: list = []
    client = Client()
    client.messages = [{"type": "http.request", "body": b"{", "more_body": True}]
    asyncio.run(_limited(seen, timeout_s=0.05)({"type": "http", "headers": []}, client.receive, client.send))
    assert seen == [] and client.sent[0]["status"] == 408


def test_body_limit_writes_nothing_when_the_client_leaves_while_sending():
    seen: list = []
    client = Client()
    client.messages = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    asyncio.run(_limited(seen)({"type": "http", "headers": []}, client.receive, client.send))
    assert seen == [] and client.sent == []
