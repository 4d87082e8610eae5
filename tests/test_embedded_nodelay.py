"""The embedded server's accepted connections send small writes at once (TCP_NODELAY), as vLLM's uvicorn does."""

import socket

from agentkv.embedded.server import LocalServer


def test_accepted_connections_have_tcp_nodelay():
    """A connection the embedded server accepted has TCP_NODELAY set, so an answer's header and body writes
    are not held back until the client's delayed ACK (about 40 ms per /tokenize over keep-alive)."""
    with LocalServer.from_size("tiny", window=1024) as server:
        with socket.create_connection((server.host, server.port)) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(65536).startswith(b"HTTP/1.1 200")
            connections = list(server._uvicorn.server_state.connections)
            flags = [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                     for c in connections]
    assert flags and all(flags)
