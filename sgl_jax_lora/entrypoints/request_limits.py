"""Request limits at the HTTP boundary: body size, JSON parsing off the event loop, generations per call.

Flow: uvicorn -> `BodySizeLimit` (ASGI middleware: a Content-Length over --max-request-body-bytes is answered
413 before any of the body is read) -> a route -> `parse_body` (reads the body counting bytes, so a chunked
body over the limit is cut off at the limit too; a body slower than --request-body-timeout is answered 408, a
client gone mid-body is a quiet 400; parses JSON larger than INLINE_PARSE_BYTES on a worker thread) ->
`check_requests_per_call` (--max-requests-per-call: prompts x n) before anything is tokenized.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from sgl_jax_lora.entrypoints.errors import APIError, error_response, validation_error_of

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState

M = TypeVar("M", bound=BaseModel)


class BodySizeLimit:
    """Answers 413 to a request whose Content-Length exceeds `limit`, without reading its body."""

    def __init__(self, app: ASGIApp, limit: int, on_refused=lambda: None):
        self.app, self.limit, self.on_refused = app, limit, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                self.on_refused()
                error = body_too_large(self.limit)
                await error_response(error.status_code, error.message, error.code)(scope, receive, send)
                return
        await self.app(scope, receive, send)


INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are parsed on a worker thread, never on the event loop


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    """The JSON body as `model`, whatever Content-Type the client sent (curl -d sends a form type); a body over
    --max-request-body-bytes is refused with 413 as soon as that many bytes have arrived. allow_empty: no body (or
    only whitespace) is `model()`, every field at its default (`curl -X POST` with no -d)."""
    args = request.app.state.server.args
    limit, timeout = args.max_request_body_bytes, args.request_body_timeout
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise body_too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within --request-body-timeout {timeout:g} s ({size} bytes came); "
            "send it at once, or ask the operator to raise the limit",
            "request_timeout",
        ) from None
    except ClientDisconnect:  # the client left mid-body: nothing to answer, and no server fault
        raise APIError(400, "the client disconnected before its request body arrived", "client_disconnected") from None
    body = b"".join(chunks)
    if allow_empty and not body.strip():
        return model()
    try:
        if len(body) <= INLINE_PARSE_BYTES:
            return model.model_validate_json(body)
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as e:
        raise validation_error_of(e) from None


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than --max-request-body-bytes {limit}; send a smaller request "
        "(fewer or shorter prompts) or ask the operator to raise the limit",
        "request_too_large",
    )


def check_requests_per_call(state: ServerState, num_prompts: int, n: int) -> None:
    """--max-requests-per-call: prompts x n engine requests from one HTTP call."""
    limit = state.args.max_requests_per_call
    if num_prompts * n > limit:
        raise APIError(
            400,
            f"this call asks for {num_prompts} prompts x n={n} = {num_prompts * n} generations, more "
            f"than --max-requests-per-call {limit}; split it into several calls",
            "invalid_request",
        )
