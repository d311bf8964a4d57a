"""A deadline on the request line and headers of every HTTP request (--request-header-timeout).

uvicorn bounds the headers' size but not their pace: a client that sends a request line and then a header byte
now and then holds its connection open for as long as it likes, and a connection that sends nothing stays too
(uvicorn's keep-alive timer starts only after a first response and stops at the next request's first byte).
The body's pace is bounded by the app (--request-body-timeout, http_server.py); this bounds what comes before it.

Flow: run_server (and a follower's /health server) give uvicorn `protocol_with_header_timeout(seconds)` as its HTTP
protocol class: uvicorn's h11 protocol, plus a timer armed when the connection opens and when the first byte of
a later request arrives, cancelled once h11 has parsed the whole request head. If it fires first, the client gets
a 408 `request_timeout` (the API's error shape) and the connection is closed. What h11 cannot parse gets the API's
error shape too, with h11's reason, where uvicorn answers plain text without one: a head past uvicorn's 16 KiB limit
(an over-long URL) a 431 `request_head_too_large`, anything else malformed a 400 `bad_http_request`. A response
sent before its request's body ended (the body timeout's 408, a 413, a route that reads no body) closes the
connection if the rest of that body has not come within the same `seconds`: uvicorn would wait for it with no timer
running, so one byte now and then held the connection for ever (closing at once would reset the connection under
the answer while the client still sends).
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

H11_HEAD_LIMIT_BYTES = 16 * 1024  # h11's default limit on a request head, which uvicorn keeps unless configured


def error_then_close(status: HTTPStatus, message: str, code: str) -> bytes:
    """A whole HTTP response in the API's error shape, written as is before the connection closes."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def timeout_response(seconds: float) -> bytes:
    """The 408 sent to a client whose request head did not arrive in time (then the connection closes)."""
    return error_then_close(
        HTTPStatus.REQUEST_TIMEOUT,
        f"the request line and headers did not arrive within --request-header-timeout {seconds:g} s; send the whole "
        "request head at once",
        "request_timeout",
    )


def unparsable_request_response(error: h11.RemoteProtocolError | None, max_head_bytes: int) -> bytes:
    """The answer to what h11 refused to parse; `error` says why (None where it was not recorded)."""
    if error is not None and error.error_status_hint == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
        return error_then_close(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"the request line and headers exceed {max_head_bytes} bytes; send a shorter URL and fewer or shorter "
            "headers (a request's data goes in its JSON body)",
            "request_head_too_large",
        )
    reason = f" ({error})" if error is not None else ""
    return error_then_close(
        HTTPStatus.BAD_REQUEST,
        f"the HTTP request could not be parsed{reason}; send a well-formed HTTP/1.1 request",
        "bad_http_request",
    )


class ParseErrorRecordingConnection(h11.Connection):
    """h11's server side of a connection, remembering why it last refused what the client sent (uvicorn drops it)."""

    protocol_error: h11.RemoteProtocolError | None = None

    def next_event(self):  # noqa: ANN201 (h11's own union of event types)
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.protocol_error = e
            raise


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline of `header_timeout_s` on each request's line and headers."""

    header_timeout_s: float = 30.0  # set per server by protocol_with_header_timeout
    header_timer: asyncio.TimerHandle | None = None

    def __init__(self, config: uvicorn.Config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.max_head_bytes = config.h11_max_incomplete_event_size or H11_HEAD_LIMIT_BYTES
        self.conn = ParseErrorRecordingConnection(h11.SERVER, self.max_head_bytes)

    def send_400_response(self, msg: str) -> None:  # uvicorn's answer to a request h11 cannot parse
        self._cancel_header_timer()
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # a response is under way: no second one
            self.transport.close()
        elif not self.transport.is_closing():
            self.transport.write(unparsable_request_response(self.conn.protocol_error, self.max_head_bytes))
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a request head begins (or goes on): its deadline runs
            self._arm_header_timer()
        discarding = self.conn.their_state is h11.SEND_BODY and self.conn.our_state is h11.DONE
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the whole head was parsed: the app has the request
            self._cancel_header_timer()
        elif discarding:  # an answered request's body ended: uvicorn re-arms no timer (its bytes cancelled them)
            self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():  # the body goes on
            self.loop.call_later(self.header_timeout_s, self._close_if_body_unread, self.cycle)  # (module docstring)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _close_if_body_unread(self, cycle: object) -> None:
        if self.cycle is cycle and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()

    def _on_header_timeout(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(timeout_response(self.header_timeout_s))
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a `seconds` deadline on each request's line and headers."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})
