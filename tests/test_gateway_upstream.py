"""The gateway's upstream client (agentkv.gateway.upstream) against real sockets: a raw asyncio server that
answers with exactly the bytes a test scripts (lengths, chunks, a close, nothing), and real uvicorn."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentkv.errors import AnswerTooLarge
from agentkv.http.transport import HttpError

from agentkv.gateway.upstream import HIGH_WATER, Upstream
from agentkv.retry import outage_cause

pytestmark = pytest.mark.asyncio


class Scripted:
    """A raw HTTP server on 127.0.0.1: each request (read up to its body) is answered by ``answer(n, request)``,
    a list of byte strings written in turn (None: close the connection there; "hang": write nothing more)."""

    def __init__(self, answer):
        self.answer, self.requests, self.connections, self.closed = answer, [], 0, 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                for piece in self.answer(len(self.requests), request):
                    if piece is None:
                        writer.close()
                        return
                    if piece == "hang":
                        await reader.read()  # until the client closes
                        self.closed += 1
                        return
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed += 1
        finally:
            writer.close()


def json_answer(body=b'{"ok": true}'):
    return [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)]


async def test_a_json_answer_is_read_whole_and_its_connection_kept():
    """Three posts on one kept connection: each request carries its length and host, each answer is read whole."""
    async with Scripted(lambda n, r: json_answer(b'{"n": %d}' % n)) as server:
        upstream = Upstream()
        for n in (1, 2, 3):
            response = await upstream.post(server.url, b'{"model": "m"}')
            assert response.status_code == 200 and response.headers["content-type"] == "application/json"
            assert json.loads(await response.aread()) == {"n": n}
            await response.aclose()
        await upstream.aclose()
    assert server.connections == 1 and upstream.opened == 1
    head = server.requests[0].decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n") and "Content-Length: 14\r\n" in head
    assert f"Host: {server.url.split('/')[2]}\r\n" in head and head.endswith('{"model": "m"}')


async def test_a_chunked_stream_arrives_chunk_by_chunk_decoded():
    """A chunked SSE answer is passed on as it comes, without its chunk framing, and the connection is kept."""
    events = [b"data: {\"i\": %d}\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]
    chunked = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    chunked += [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    async with Scripted(lambda n, r: chunked) as server:
        upstream = Upstream()
        for _ in range(2):
            response = await upstream.post(server.url, b"{}")
            assert b"".join([chunk async for chunk in response.aiter_raw()]) == b"".join(events)
            await response.aclose()
        await upstream.aclose()
    assert server.connections == 1


async def test_an_answer_ended_by_the_close_is_read_to_the_close():
    """An answer with neither a length nor chunks ends when the server closes (and the connection is not kept)."""
    async with Scripted(lambda n, r: [b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart one, ", b"part two", None]) \
            as server:
        upstream = Upstream()
        response = await upstream.post(server.url, b"{}")
        assert await response.aread() == b"part one, part two"
        await response.aclose()
        assert upstream.start(server.url, b"{}") is None  # nothing kept
        await upstream.aclose()


async def test_a_kept_connection_the_server_closed_is_replaced_and_the_request_sent_once_more():
    """The server answers, then closes the kept connection: the next post goes out on a new one and is answered."""
    async with Scripted(lambda n, r: json_answer() + [None]) as server:
        upstream = Upstream()
        for _ in range(3):
            response = await upstream.post(server.url, b"{}")
            assert await response.aread() == b'{"ok": true}'
            await response.aclose()
            await asyncio.sleep(0.05)  # the close lands while the connection is idle
        await upstream.aclose()
    assert server.connections == 3


async def test_a_stale_connection_closed_under_a_request_is_retried_on_a_new_one():
    """A kept connection whose server closes it without an answer (as the request goes out) is replaced once."""
    answers = {1: json_answer(), 2: [None]}  # the second request's connection closes without an answer
    async with Scripted(lambda n, r: answers.get(n, json_answer(b'{"retried": true}'))) as server:
        upstream = Upstream()
        response = await upstream.post(server.url, b"{}")
        await response.aread()
        await response.aclose()
        response = await upstream.post(server.url, b"{}")
        assert json.loads(await response.aread()) == {"retried": True}
        await upstream.aclose()
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_refused_connection_is_an_outage_the_session_fails_over_on():
    """Nothing listens: an HttpError of kind "outage" (never an httpx error), whose cause says "refused"."""
    async with Scripted(lambda n, r: json_answer()) as server:
        url = server.url
    with pytest.raises(HttpError) as raised:
        await Upstream().post(url, b"{}")
    assert raised.value.kind == "outage" and outage_cause(raised.value) == "refused"


async def test_a_server_that_sends_nothing_times_out_and_is_closed():
    """No answer within the read timeout: an HttpError of kind "timeout", and the server sees its connection
    closed."""
    async with Scripted(lambda n, r: ["hang"]) as server:
        upstream = Upstream(read_timeout_s=0.2)
        with pytest.raises(HttpError) as raised:
            await upstream.post(server.url, b"{}")
        assert raised.value.kind == "timeout" and outage_cause(raised.value) == "timeout"
        for _ in range(50):
            if server.closed:
                break
            await asyncio.sleep(0.02)
        assert server.closed == 1
        await upstream.aclose()


async def test_a_stream_that_stops_mid_answer_raises_and_a_bad_answer_does_not_parse():
    """A close inside a chunked body is a dropped connection (never a complete answer); garbage does not parse:
    each an HttpError of kind "outage" that outage_cause reads as "dropped"."""
    cut = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", None]
    async with Scripted(lambda n, r: cut) as server:
        response = await Upstream().post(server.url, b"{}")
        with pytest.raises(HttpError) as raised:
            await response.aread()
        assert raised.value.kind == "outage" and outage_cause(raised.value) == "dropped"
    async with Scripted(lambda n, r: [b"NOT HTTP AT ALL\r\n\r\n", "hang"]) as server:
        with pytest.raises(HttpError) as raised:
            await Upstream().post(server.url, b"{}")
        assert raised.value.kind == "outage" and outage_cause(raised.value) == "dropped"


async def test_an_answer_over_the_cap_is_refused_and_a_stream_is_not_buffered_whole():
    """aread stops past max_answer_bytes (AnswerTooLarge: neither retried nor failed over); a stream read slowly pauses
    the socket instead of buffering it all."""
    big = b"x" * (HIGH_WATER * 3)
    async with Scripted(lambda n, r: json_answer(big)) as server:
        upstream = Upstream(max_answer_bytes=1 << 20)
        response = await upstream.post(server.url, b"{}")
        with pytest.raises(AnswerTooLarge, match="over 1048576 bytes"):
            await response.aread()
        response = await Upstream().post(server.url, b"{}")
        first = await response.aiter_raw().__anext__()
        await asyncio.sleep(0.2)  # the server keeps writing; the client reads no more
        connection = response._connection
        assert connection._paused and connection._buffered < HIGH_WATER * 2
        assert len(first) + connection._buffered < len(big)
        await response.aclose()


async def test_an_answer_that_paused_reading_as_it_ended_leaves_a_connection_that_reads_again():
    """An answer just over the high-water mark, all in at once: reading paused on its last bytes, and the kept
    connection it goes back to reads the next answer (a short one) at once."""
    answers = {1: json_answer(b"x" * (HIGH_WATER + 1000)), 2: json_answer(b'{"n": 2}')}
    async with Scripted(lambda n, r: answers[n]) as server:
        upstream = Upstream(read_timeout_s=3)
        response = await upstream.post(server.url, b"{}")
        await asyncio.sleep(0.1)  # the whole answer is in before it is read
        assert len(await response.aread()) == HIGH_WATER + 1000
        response = await asyncio.wait_for(upstream.post(server.url, b"{}"), 2)
        assert json.loads(await response.aread()) == {"n": 2} and upstream.opened == 1
        await upstream.aclose()


async def test_closing_a_response_early_closes_its_connection():
    """A client that leaves mid-stream: the response is closed before its end, so the backend sees the close."""
    head = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n", "hang"]
    async with Scripted(lambda n, r: head) as server:
        upstream = Upstream()
        response = await upstream.post(server.url, b"{}")
        assert await response.aiter_raw().__anext__() == b"first"
        await response.aclose()
        for _ in range(50):
            if server.closed:
                break
            await asyncio.sleep(0.02)
        assert server.closed == 1 and upstream.start(server.url, b"{}") is None


async def test_start_writes_at_once_and_a_cancelled_start_is_abandoned():
    """start() puts the request on the wire on a kept connection before anything is awaited; cancel() drops it."""
    async with Scripted(lambda n, r: json_answer(b'{"n": %d}' % n)) as server:
        upstream = Upstream()
        assert upstream.start(server.url, b"{}") is None  # no kept connection yet
        await (await upstream.post(server.url, b"{}")).aread()
        started = upstream.start(server.url, b'{"early": 1}')
        assert started is not None
        answered = await started.response()
        assert json.loads(await answered.aread()) == {"n": 2}
        cancelled = upstream.start(server.url, b'{"early": 2}')
        cancelled.cancel()
        response = await upstream.post(server.url, b"{}")  # a new connection: the cancelled one is closed
        assert response.status_code == 200
        await upstream.aclose()
    assert server.requests[1].endswith(b'{"early": 1}') and upstream.opened == 2


async def test_against_uvicorn():
    """Real uvicorn (httptools): JSON answers on a kept connection and a streamed answer, as the gateway reads them."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if json.loads(body).get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(3):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    upstream = Upstream()
    try:
        for n in range(3):
            response = await upstream.post(url, json.dumps({"n": n}).encode())
            assert response.status_code == 201 and json.loads(await response.aread()) == {"n": n}
        response = await upstream.post(url, b'{"stream": true}')
        assert b"".join([c async for c in response.aiter_raw()]) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert upstream.opened == 1
    finally:
        await upstream.aclose()
        server.should_exit = True
        await task
