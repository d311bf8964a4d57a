"""The SGLang-style native API: POST /generate, GET /health, GET /get_server_info, GET /get_model_info,
POST /abort_request, POST /flush_cache, POST /start_profile and /stop_profile, POST /load_lora_adapter and
/unload_lora_adapter (also under /v1/).

Flow: JSON body -> pydantic model (wrong types -> 400) -> the request front door (managers/request_normalizer.py:
`normalize`, then --max-requests-per-call, then `build_requests`: one `GenerateRequest` per prompt and sample, all
validated before any is sent; a refused prompt of a batch is named, entrypoints/errors.py) -> results collected,
or streamed as server-sent events (`data: {...}` per increment, then `data: [DONE]`). The streaming and
disconnect helpers here are shared with openai_api.py: a client that goes away cancels its generators,
which aborts its requests in the engine and frees their KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
from collections.abc import AsyncIterator, Awaitable
from importlib import metadata
from typing import TYPE_CHECKING, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from sgl_jax_lora.entrypoints.errors import APIError, error_body, error_response, to_api_error
from sgl_jax_lora.entrypoints.openai_protocol import WholeNumber
from sgl_jax_lora.entrypoints.request_limits import check_requests_per_call, parse_body
from sgl_jax_lora.entrypoints.text_deltas import TextDeltas
from sgl_jax_lora.managers.io_struct import FlushCacheCall, ServerInfoCall, StartProfileCall, StopProfileCall
from sgl_jax_lora.managers.request_normalizer import HTTP, build_requests, normalize, prompt_count
from sgl_jax_lora.utils.gather import gather_or_cancel
from sgl_jax_lora.utils.gc_freeze import collector_stats

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
VERSIONED_PACKAGES = ("sgl_jax_lora", "jax", "jaxlib", "flax", "transformers", "fastapi", "uvicorn", "pydantic")

public_router = APIRouter()  # no API key: liveness probes must work without secrets
router = APIRouter()


class GenerateReqInput(BaseModel):
    """POST /generate. One prompt (`text` or `input_ids`) or a batch (lists), SGLang field names."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: WholeNumber = -1
    top_logprobs_num: WholeNumber = 0
    lora_path: str | list[str | None] | None = None
    priority: WholeNumber = 0  # lower is served first (--scheduling-policy priority)
    rid: str | list[str] | None = None  # the client's name for each request: its meta_info.id, /abort_request's


class AbortReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str


class StartProfileReqInput(BaseModel):
    """POST /start_profile: its body may be empty (trace until /stop_profile)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_steps: int | None = None  # the trace stops by itself after this many steps


class LoadLoRAAdapterReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str


# ---- routes ------------------------------------------------------------------------------------
@public_router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the engine is up; 503 while it starts or after its process died."""
    state: ServerState = request.app.state.server
    state.engine()
    return JSONResponse({"status": "ok"})


@router.post("/generate", response_model=None)
async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateReqInput)
    state: ServerState = request.app.state.server
    tm = state.engine()
    check_requests_per_call(state, prompt_count(body.text, body.input_ids), 1)  # before any per-prompt work
    batch = normalize(
        body.text,
        body.input_ids,
        body.sampling_params,
        body.lora_path,
        body.return_logprob,
        body.logprob_start_len,
        body.top_logprobs_num,
        dialect=HTTP,
        priority=body.priority,
        rid=body.rid,
    )
    check_requests_per_call(state, batch.num_prompts, batch.copies_per_prompt)
    requests = await build_requests(tm, batch)  # all validated before any is sent
    streams = [state.metrics.track(tm.generate_request(r, every_increment=body.stream), "generate") for r in requests]
    if body.stream:
        streams = [_text_never_taken_back(s, r.sampling.stop) for s, r in zip(streams, requests, strict=True)]
        return await streaming_response(request, _generate_events(streams, batch.answers_list))
    results = await run_unless_disconnected(request, gather_or_cancel([last_result(s) for s in streams]))
    return JSONResponse(results if batch.answers_list else results[0])


@router.post("/abort_request")
async def abort_request(request: Request) -> JSONResponse:
    """SGLang's /abort_request: stop the running request named by its rid (the client's, or the meta_info.id the
    server gave it); it finishes with finish_reason abort and frees its pages. `aborted`: whether one was running."""
    body = await parse_body(request, AbortReqInput)
    tm = request.app.state.server.engine()
    engine_rid = tm.request_ids.engine_rid(body.rid)
    running = tm.client.has_stream(engine_rid)
    if running:
        tm.abort(engine_rid)
    return JSONResponse({"success": True, "aborted": running})


@router.post("/flush_cache")
async def flush_cache(request: Request) -> JSONResponse:
    """SGLang's /flush_cache: the prefix cache's pages that no request holds are freed (a benchmark starts cold)."""
    tm = request.app.state.server.engine()
    flushed = await tm.call(FlushCacheCall())
    return JSONResponse({"success": True, "kv_pages_freed": flushed.kv_pages_freed})


@router.post("/start_profile")
async def start_profile(request: Request) -> JSONResponse:
    """SGLang's /start_profile: a jax.profiler trace of the engine's next `num_steps` steps (or until /stop_profile)
    into a new directory under --profile-dir; 400 naming the flag when the server runs without it."""
    body = await parse_body(request, StartProfileReqInput, allow_empty=True)
    started = await request.app.state.server.engine().call(StartProfileCall(body.num_steps))
    return JSONResponse({"success": True, "trace_dir": started.trace_dir, "num_steps": started.num_steps})


@router.post("/stop_profile")
async def stop_profile(request: Request) -> JSONResponse:
    """SGLang's /stop_profile: the running trace ends and its files are written."""
    stopped = await request.app.state.server.engine().call(StopProfileCall())
    return JSONResponse({"success": True, "trace_dir": stopped.trace_dir, "num_steps": stopped.num_steps})


@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    tm = state.engine()
    engine_info = await tm.call(ServerInfoCall())
    server_args = state.args.info_dict()
    return JSONResponse(
        {
            **engine_info,
            "server_args": server_args,
            "served_model_name": state.served_model_name,
            "model_path": state.model_path,
            "engine_pid": tm.process.pid,
            "num_requests_held": tm.num_requests_held,
            "max_requests_held": tm.max_requests_held,
            "frontend_rss_bytes": rss_bytes(os.getpid()),
            "engine_rss_bytes": rss_bytes(tm.process.pid),
            "frontend_gc": collector_stats(),
            "versions": state.versions,
        }
    )


@router.get("/get_model_info")
async def get_model_info(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    tm = state.engine()
    return JSONResponse(
        {
            "model_path": state.model_path,
            "tokenizer_path": state.args.tokenizer_path or state.model_path,
            "served_model_name": state.served_model_name,
            "context_length": tm.context_length,
            "is_generation": True,
        }
    )


@router.post("/load_lora_adapter")
@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> JSONResponse:
    body = await parse_body(request, LoadLoRAAdapterReqInput)
    state: ServerState = request.app.state.server
    tm = lora_engine(state, body.lora_name)
    with state.metrics.time_lora_load():
        result = await tm.load_lora_adapter(body.lora_name, body.lora_path, pinned=body.pinned)
    return JSONResponse({"success": True, **result})


@router.post("/unload_lora_adapter")
@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> JSONResponse:
    body = await parse_body(request, UnloadLoRAAdapterReqInput)
    state: ServerState = request.app.state.server
    tm = lora_engine(state, body.lora_name)
    result = await tm.unload_lora_adapter(body.lora_name)
    return JSONResponse({"success": True, **result})


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` (Linux /proc; None elsewhere): soak runs watch both processes for leaks."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def lora_engine(state: ServerState, lora_name: str) -> TokenizerManager:
    tm = state.engine()
    if not state.args.enable_lora:
        raise APIError(
            400,
            f"adapter '{lora_name}': LoRA is not enabled on this server; restart with --enable-lora or --lora-paths",
            "lora_disabled",
        )
    return tm


# ---- streaming and disconnects (shared with openai_api) ----------------------------------------
async def last_result(results: AsyncIterator[dict]) -> dict:
    result = None
    async for result in results:  # noqa: B007 - keeps the last
        pass
    return result


async def run_unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it (aborting its engine requests)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled():
        raise APIError(400, "client disconnected; request aborted", "client_disconnected")
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def streaming_response(request: Request, events: AsyncIterator[str]) -> Response:
    """An SSE response of `events` then `data: [DONE]`.

    The first event is awaited here, before the response starts, so that a request the engine refuses
    gets a plain 4xx/5xx; a later error becomes an error event before [DONE]. A client that leaves at
    any point closes `events`, which aborts its engine requests.
    """
    try:
        first = await run_unless_disconnected(request, anext(events))
    except StopAsyncIteration:
        first = None
    except Exception as e:
        await events.aclose()
        error = to_api_error(e)
        return error_response(error.status_code, error.message, error.code, error.param)

    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):
                if first is not None:
                    yield first
                    async for event in events:
                        yield event
        except Exception as e:
            error = to_api_error(e)
            yield sse(error_body(error.status_code, error.message, error.code, error.param))
        yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from several async iterators as items arrive, each waiting while its last item is not taken;
    closing this cancels them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield 0, item
        return
    # bounded: a stream whose items are not taken waits (and its results coalesce in generate_request) rather than
    # piling up here for a client that does not read
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
            await queue.put((index, done))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _text_never_taken_back(results: AsyncIterator[dict], stop: list[str]) -> AsyncIterator[dict]:
    """A stream's cumulative results, each unfinished one's text cut where TextDeltas cuts it: a later event's text
    always extends an earlier one's (a tail that may begin a stop string waits until it is certain)."""
    deltas = TextDeltas(stop)
    async with contextlib.aclosing(results):
        async for result in results:
            finished = result["meta_info"]["finish_reason"] is not None
            deltas.delta(result["text"], finished)
            yield result if finished else {**result, "text": result["text"][: deltas.num_sent]}


async def _generate_events(streams: list[AsyncIterator[dict]], is_batch: bool) -> AsyncIterator[str]:
    merged = merge_streams(streams)
    async with contextlib.aclosing(merged):
        async for index, result in merged:
            yield sse({**result, "index": index} if is_batch else result)


def package_versions() -> dict:
    """Versions of Python and the main packages; read once when the app is built (importlib.metadata scans every
    installed distribution: tens of milliseconds, too long for the event loop on every /get_server_info)."""
    versions = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions
