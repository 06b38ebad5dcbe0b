"""The HTTP connection: uvicorn's h11 protocol with a deadline for each request to arrive whole.

uvicorn holds a connection that never finishes its headers (or its body) for as long as the client
likes: a few such clients (slowloris) tie up the server's connections. Here each request's headers and
body must arrive within `read_timeout_s` of its first byte (of the connection's opening, for the
first); past that the connection is closed, and a handler still waiting for the body sees the client
gone. Keep-alive waits between requests stay uvicorn's (`--timeout-keep-alive`).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class DeadlineH11Protocol(H11Protocol):
    read_timeout_s: float = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
            self._arm()  # a request has started and is not whole yet (armed once: its deadline stands)
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # between requests, uvicorn's keep-alive timeout applies

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.warning("closing a connection whose request did not arrive within %.0f s", self.read_timeout_s)
            self.transport.close()


def protocol_with_read_timeout(read_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http=`, with this deadline."""
    if not read_timeout_s > 0:
        raise ValueError(f"--request-read-timeout must be positive, got {read_timeout_s}")
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"read_timeout_s": read_timeout_s})
