"""GET /health_generate: whether the engine still makes progress, for a liveness probe that must tell a stuck engine
from a busy one (GET /health answers for the processes alone: a wedged engine process still passes it).

Flow: the route -> `check_engine_progress(tm, timeout)`: one check at a time (checks that arrive meanwhile share it). It
sends a 1-token greedy request on the base model and passes as soon as the engine sends anything (that request's
token, or any other request's output or any call's reply: a busy engine answers with its running requests' tokens
long before a new request would be admitted) within --health-check-timeout seconds; the request is aborted when the
check ends either way.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse

from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.managers.engine_client import EngineDeadError, ServerBusyError
from sgl_jax_lora.managers.request_normalizer import HTTP, build_requests, normalize

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

PROBE_PROMPT = "health"


async def health_generate(request: Request) -> JSONResponse:
    """200 when the engine made progress within --health-check-timeout; 503 when it did not, or cannot serve."""
    state: ServerState = request.app.state.server
    tm = state.engine()
    if state.progress_check is None or state.progress_check.done():
        state.progress_check = asyncio.ensure_future(check_engine_progress(tm, state.args.health_check_timeout))
    await asyncio.shield(state.progress_check)  # a caller that goes away leaves the check to the others
    return JSONResponse({"status": "ok"})


async def check_engine_progress(tm: TokenizerManager, timeout: float) -> None:
    """Returns once the engine sent a message after a probe request went in; APIError 503 after `timeout` seconds
    of silence, or when the engine process is gone."""
    progress = tm.client.next_message()
    probe = asyncio.ensure_future(_probe(tm))
    try:
        done, _ = await asyncio.wait({progress, probe}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if progress in done:
            if isinstance(progress.exception(), EngineDeadError):
                raise APIError(503, "the engine process has exited; the server is shutting down", "engine_dead")
            return
        if probe in done:
            probe.result()  # the probe could not be sent: its error
        raise APIError(
            503,
            f"the engine sent nothing for {timeout:g} s while a 1-token request waited: it is stuck; restart the "
            "server (or raise --health-check-timeout if one step of yours takes that long)",
            "engine_unresponsive",
        )
    finally:
        probe.cancel()  # aborts the probe request if it still runs
        progress.cancel()


async def _probe(tm: TokenizerManager) -> None:
    """One greedy token on the base model; a server that holds all the requests it may is busy, not stuck: then
    only the other requests' progress answers the check."""
    params = {"max_new_tokens": 1, "temperature": 0.0}
    requests = await build_requests(tm, normalize(PROBE_PROMPT, None, params, dialect=HTTP))
    try:
        async for _ in tm.generate_request(requests[0], every_increment=False):
            pass
    except ServerBusyError:
        await asyncio.Event().wait()  # until the check ends
