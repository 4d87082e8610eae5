"""Uvicorn's HTTP/1.1 protocol with a deadline on request headers: a client that opens a connection (or leaves one
idle after an answer) and drips or withholds its headers is disconnected after ``timeout_s``.

Uvicorn alone would hold such a connection forever: it arms its keep-alive timer only after an answer and cancels
it on any byte received, so one byte every few seconds keeps a slot open (a slowloris). The deadline counts from
when the connection opened or its previous answer ended, and any data does not move it; it is cancelled once the
request line and headers are complete (the body has its own deadline, in :mod:`agentkv.embedded.server.asgi`).

Usage::

    uvicorn.Config(app, http=deadline_protocol(30.0), ...)
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["deadline_protocol"]


def deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """An ``H11Protocol`` subclass closing connections whose headers take longer than ``timeout_s``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # headers complete (or a protocol error): stop the clock
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
