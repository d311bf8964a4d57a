"""Draining on SIGTERM: the server stops taking requests, lets the running ones finish, then stops.

Where it sits: http_server.py serves with `DrainingServer` (uvicorn's server, whose SIGTERM handler starts the drain)
and wraps its app in `InFlightRequests` (the ASGI middleware that counts the requests being served and, once the
server drains, answers new ones with `draining_error`'s 503). Both read and write the ServerState of http_server.py:
`is_draining`, `num_in_flight`, its event loop and its args (--shutdown-timeout).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import TYPE_CHECKING

import uvicorn

from sgl_jax_lora.entrypoints.errors import APIError, error_response

if TYPE_CHECKING:  # type only: http_server.py imports this module
    from sgl_jax_lora.entrypoints.http_server import ServerState

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a drain looks whether the running requests are done


def draining_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down (SIGTERM): it finishes running requests and takes no new ones; "
        "retry on another replica or after it restarts",
        "shutting_down",
    )


class InFlightRequests:
    """ASGI middleware: counts the HTTP requests being served (streams until their last byte) and, once the
    server drains, answers every new one but /health (which says 503 itself) with 503."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return
        if self.state.is_draining:
            error = draining_error()
            await error_response(error.status_code, error.message, error.code)(scope, receive, send)
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains first: new requests get 503, running ones may finish for up to
    --shutdown-timeout seconds, then the server stops (exit code 0). SIGINT, or a second SIGTERM, stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        state = self.state
        if sig != signal.SIGTERM or state.is_draining or state.loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised after shutdown and swallowed by run_server's handler
        state.is_draining = True
        logger.info(
            "SIGTERM: draining %d requests (up to --shutdown-timeout %gs)",
            state.num_in_flight,
            state.args.shutdown_timeout,
        )
        state.loop.call_soon_threadsafe(lambda: state.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.args.shutdown_timeout
        while self.state.num_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.num_in_flight:
            logger.warning(
                "--shutdown-timeout passed with %d requests still running; stopping them", self.state.num_in_flight
            )
        self.should_exit = True
