"""Deadlines for reading a request, so that slow clients (slowloris) cannot hold connections.

uvicorn closes a keep-alive connection that stays idle between requests (`timeout_keep_alive`),
but waits forever for a request that arrives a byte at a time. `timed_h11_protocol` gives its
h11 protocol two more deadlines:

- headers: a connection's first request must have sent all its headers within
  `header_timeout_s` of the connection opening; a later request on a keep-alive connection,
  within `header_timeout_s` of its first byte (the wait before that byte is keep-alive's);
- body: a request's body must have arrived whole within `body_timeout_s` of its headers.

A request cut short gets `408 Request Timeout` (when nothing has been answered yet) and the
connection is closed; a connection that never sent a byte is closed without an answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("tgis.server")

Phase = Literal["headers", "body"]


def _timeout_response(message: str) -> bytes:
    body = message.encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers and one for its body.

    The deadlines are class attributes: `timed_h11_protocol` makes a subclass with the
    server's (uvicorn builds one protocol object per connection from the class).
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    _read_phase: Phase | None = None
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request buffered while the response was written is read now.
        self._follow()

    def _reading(self) -> Phase | None:
        """What the connection waits for from the client now, if it is a part of a request."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return "body"
        if state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            # The first request, or some bytes of the next one: its headers are incomplete.
            return "headers"
        return None  # a request complete (its answer pending), idle between requests, closing

    def _follow(self) -> None:
        """Arm the deadline of what is being read (kept while the same part is read), or none."""
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            self._disarm()  # closed, or handed to another protocol (a WebSocket upgrade)
            return
        phase = self._reading()
        if phase is None:
            self._disarm()
            if (
                self.conn.our_state is h11.IDLE
                and self.conn.their_state is h11.IDLE
                and self.timeout_keep_alive_task is None
            ):
                # Idle between requests after a body that ended once its answer was sent
                # (uvicorn arms keep-alive's wait at the answer, and stops it at the body's
                # bytes): the wait is keep-alive's again.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        elif phase != self._read_phase:
            if phase == "headers":
                # Bytes of a new request on a keep-alive connection: no longer idle.
                self._unset_keepalive_if_required()
            self._arm(phase)

    def _arm(self, phase: Phase) -> None:
        self._disarm()
        delay = self.header_timeout_s if phase == "headers" else self.body_timeout_s
        self._read_phase = phase
        self._read_timer = self.loop.call_later(delay, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = None
        self._read_phase = None

    def _timed_out(self) -> None:
        phase = self._read_phase
        self._read_timer = None
        self._read_phase = None
        if self.transport.is_closing():
            return
        if phase == "body":
            cycle = self.cycle
            begun, answer = True, not cycle.response_started
            # The app's receive() now reports a disconnect, and what it sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            message = f"The request body did not arrive within {self.body_timeout_s:g} s."
        else:
            begun = answer = bool(self.conn.trailing_data[0])  # silence gets no answer
            message = f"The request headers did not arrive within {self.header_timeout_s:g} s."
        if begun:
            client = "{}:{}".format(*self.client) if self.client else "a client"
            logger.info("closing the connection of %s: %s", client, message)
        if answer:
            self.transport.write(_timeout_response(message))
        self.transport.close()


def timed_h11_protocol(header_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
    """The h11 protocol class for `uvicorn.Config(http=...)` with these deadlines (seconds)."""
    deadlines = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s}
    return type("TimedH11Protocol", (TimedH11Protocol,), deadlines)
