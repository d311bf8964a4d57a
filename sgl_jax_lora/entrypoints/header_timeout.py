"""A deadline on the request line and headers of every HTTP request (--request-header-timeout).

uvicorn bounds the headers' size but not their pace: a client that sends a request line and then a header byte
now and then holds its connection open for as long as it likes, and a connection that sends nothing stays too
(uvicorn's keep-alive timer starts only after a first response and stops at the next request's first byte).
The body's pace is bounded by the app (--request-body-timeout, http_server.py); this bounds what comes before it.

Flow: run_server (and a follower's /health server) give uvicorn `protocol_with_header_timeout(seconds)` as its HTTP
protocol class: uvicorn's h11 protocol, plus a timer armed when the connection opens and when the first byte of
a later request arrives, cancelled once h11 has parsed the whole request head. If it fires first, the client gets
a 408 `request_timeout` (the API's error shape) and the connection is closed.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def timeout_response(seconds: float) -> bytes:
    """The 408 sent to a client whose request head did not arrive in time (then the connection closes)."""
    body = json.dumps(
        {
            "error": {
                "message": f"the request line and headers did not arrive within --request-header-timeout {seconds:g} s;"
                " send the whole request head at once",
                "type": "invalid_request_error",
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def protocol_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a `seconds` deadline on each request's line and headers."""

    class HeaderTimeoutProtocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # a request head begins (or goes on): its deadline runs
                self._arm_header_timer()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the whole head was parsed: the app has the request
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(seconds, self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _on_header_timeout(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(timeout_response(seconds))
                self.transport.close()

    return HeaderTimeoutProtocol
