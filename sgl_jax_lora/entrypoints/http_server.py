"""The HTTP server: a FastAPI app over one TokenizerManager, served by uvicorn.

Flow: `run_server(args)` builds the app and runs uvicorn. The app's lifespan binds the port at once and
starts the engine process on a background thread, so `/health` answers 503 while the engine compiles and
200 once it is up. A watchdog on the engine process's sentinel notices if it dies: `/health` turns 503,
in-flight requests fail with 503, and the server exits with a non-zero code. SIGINT/SIGTERM (uvicorn's
handlers) stop accepting, then the lifespan shutdown stops the engine process, leaving no orphan; SIGTERM
first drains (draining.py: new requests 503, running ones finish up to --shutdown-timeout). Bodies over
--max-request-body-bytes are refused before they are read (request_limits.py), request heads slower than
--request-header-timeout get 408 (header_timeout.py).

Routes live in native_api.py (/generate, /health, /get_server_info, /flush_cache, LoRA load/unload),
health_check.py (/health_generate: the engine still makes progress), openai_api.py (/v1/...), lora_tensors_api.py
(adapters sent as tensors) and tokenize_api.py (/tokenize, /detokenize); errors.py shapes every error; metrics.py
counts. Every route but /health and /health_generate requires the API key when --api-key is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from sgl_jax_lora.entrypoints import health_check, lora_tensors_api, native_api, openai_api, tokenize_api
from sgl_jax_lora.entrypoints.chat_template import load_chat_template
from sgl_jax_lora.entrypoints.draining import DrainingServer, InFlightRequests, draining_error
from sgl_jax_lora.entrypoints.errors import APIError, install_error_handlers
from sgl_jax_lora.entrypoints.header_timeout import protocol_with_header_timeout
from sgl_jax_lora.entrypoints.metrics import ServerMetrics
from sgl_jax_lora.entrypoints.request_limits import BodySizeLimit
from sgl_jax_lora.managers.engine_client import EngineStartupError
from sgl_jax_lora.managers.io_struct import ServerInfoCall
from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager
from sgl_jax_lora.server_args import ServerArgs, served_model_name
from sgl_jax_lora.utils.gc_freeze import freeze_startup_objects

logger = logging.getLogger(__name__)

# After the engine dies, keep answering 503 this long before exiting, so that in-flight requests get
# their error and a health checker polling /health sees the 503 rather than only a refused connection.
ENGINE_DEATH_GRACE_S = 1.0


@dataclasses.dataclass
class ServerState:
    """What every handler needs, held on `app.state.server`."""

    args: ServerArgs
    model_path: str
    served_model_name: str
    metrics: ServerMetrics
    chat_template: str | None = None  # --chat-template, read; None = the tokenizer's (or the default)
    versions: dict = dataclasses.field(default_factory=dict)  # Python and package versions, for /get_server_info
    tokenizer_manager: TokenizerManager | None = None  # None until the engine is up
    startup_error: str | None = None
    started_at: int = dataclasses.field(default_factory=lambda: int(time.time()))  # the base model card's `created`
    is_shutting_down: bool = False
    is_draining: bool = False  # SIGTERM: new requests get 503 while the running ones finish
    num_in_flight: int = 0  # HTTP requests being served (/health excluded)
    loop: asyncio.AbstractEventLoop | None = None
    exit_code: int = 0
    request_exit: Callable[[int], None] = lambda code: None  # set by run_server: stops uvicorn
    is_exiting: Callable[[], bool] = lambda: False  # set by run_server: uvicorn got SIGINT/SIGTERM
    progress_check: asyncio.Future | None = None  # GET /health_generate's check in progress (health_check.py)

    @property
    def is_ready(self) -> bool:
        tm = self.tokenizer_manager
        return tm is not None and not tm.is_dead and tm.process.is_alive()

    def engine(self) -> TokenizerManager:
        """The TokenizerManager, or a 503 APIError saying why the engine cannot serve."""
        if self.is_draining:
            raise draining_error()
        tm = self.tokenizer_manager
        if tm is not None and not tm.is_dead and tm.process.is_alive():
            return tm
        if self.startup_error:
            raise APIError(503, f"the engine failed to start: {self.startup_error}", "engine_dead")
        if tm is None:
            raise APIError(
                503, "the engine is starting (compiling); retry when GET /health answers 200", "engine_starting"
            )
        raise APIError(503, "the engine process has exited; the server is shutting down", "engine_dead")


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def require_api_key(request: Request) -> None:
    """Dependency of every route but /health: `Authorization: Bearer KEY` when --api-key is set."""
    api_key = get_state(request).args.api_key
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        message = "missing API key: send 'Authorization: Bearer KEY'" if not header else "invalid API key"
        raise APIError(401, message, "invalid_api_key")


def create_app(args: ServerArgs, model_path: str) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine process in the background and stops it at exit."""
    state = ServerState(
        args=args,
        model_path=model_path,
        served_model_name=served_model_name(args, model_path),
        metrics=ServerMetrics(),
        chat_template=load_chat_template(args.chat_template),
        versions=native_api.package_versions(),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        starter = asyncio.create_task(_start_engine(state))
        yield
        state.is_shutting_down = True
        starter.cancel()
        if state.tokenizer_manager is not None:
            await asyncio.to_thread(state.tokenizer_manager.shutdown)
        _stop_unfinished_children()

    # The interactive docs and the OpenAPI schema are served without a key only on a server that asks for none
    # (a browser's docs page cannot send the key with its schema request).
    docs = {} if not args.api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="sgl_jax_lora", lifespan=lifespan, **docs)
    app.state.server = state
    app.add_middleware(InFlightRequests, state=state)
    app.add_middleware(
        BodySizeLimit, limit=args.max_request_body_bytes, on_refused=lambda: state.metrics.errors.labels("413").inc()
    )
    install_error_handlers(app, on_error=state.metrics.count_error)
    app.include_router(native_api.public_router)
    app.add_api_route("/health_generate", health_check.health_generate, methods=["GET"])  # public, as /health
    protected = [Depends(require_api_key)]
    app.include_router(native_api.router, dependencies=protected)
    app.include_router(openai_api.router, dependencies=protected)
    app.include_router(lora_tensors_api.router, dependencies=protected)
    app.include_router(tokenize_api.router, dependencies=protected)

    @app.get("/metrics", dependencies=protected)
    async def metrics(request: Request) -> Response:
        tm = state.tokenizer_manager
        if state.is_ready:
            state.metrics.set_engine_stats(await tm.call(ServerInfoCall()))
        body = await asyncio.to_thread(state.metrics.render)  # every series, formatted: kept off the event loop
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _start_engine(state: ServerState) -> None:
    """Spawn the engine (blocking until it is compiled) off the event loop, then watch its process."""
    loop = asyncio.get_running_loop()
    built: asyncio.Future = loop.create_future()

    def build() -> None:
        try:
            tm = TokenizerManager(state.args, state.model_path)
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which logs it and exits
            loop.call_soon_threadsafe(_resolve, built, None, e)
            return
        if state.is_shutting_down:
            tm.shutdown()
            return
        loop.call_soon_threadsafe(_resolve, built, tm, None)

    # A daemon thread, not the default executor: a shutdown during startup must not wait for compilation.
    threading.Thread(target=build, name="engine-startup", daemon=True).start()
    try:
        tm = await built
    except Exception as e:
        state.startup_error = e.reason if isinstance(e, EngineStartupError) else f"{type(e).__name__}: {e}"
        logger.error("engine failed to start: %s", state.startup_error)
        _exit_after_engine_failure(state, delay=0.0)
        return
    tm.start(loop)
    state.tokenizer_manager = tm
    freeze_startup_objects()  # the app, tokenizer and engine client leave the collector's generations (gc_freeze.py)
    loop.add_reader(tm.process.sentinel, _on_engine_exit, state, loop)
    base = f"http://{state.args.host}:{state.args.port}"
    print(f"sgl_jax_lora ready: serving '{state.served_model_name}' at {base} (OpenAI API: {base}/v1)", flush=True)


def _resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))
    else:
        future.set_result(result)


def _on_engine_exit(state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
    tm = state.tokenizer_manager
    loop.remove_reader(tm.process.sentinel)
    # Ctrl-C in a terminal signals the whole process group, the engine included: not a failure.
    if state.is_shutting_down or state.is_exiting():
        return
    tm.process.join(timeout=1)
    logger.error("the engine process exited unexpectedly (exit code %s); shutting the server down", tm.process.exitcode)
    tm.is_dead = True
    _exit_after_engine_failure(state, delay=ENGINE_DEATH_GRACE_S)


def _exit_after_engine_failure(state: ServerState, delay: float) -> None:
    state.exit_code = 1
    asyncio.get_running_loop().call_later(delay, state.request_exit, 1)


def _stop_unfinished_children() -> None:
    """Stop an engine process whose startup was still running when the server shut down."""
    for child in mp.active_children():
        child.terminate()
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


class StartupProbeFilter(logging.Filter):
    """Drops uvicorn's access-log line of each `GET /health` 503 while the engine starts: a health checker
    polls every second or so, and a screen of "503 Service Unavailable" reads as a failure. The progress
    of the startup is on the console instead (utils/progress.py); every other line is kept."""

    def __init__(self, state: ServerState):
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True
        is_probe = args[2] == "/health" and args[4] == 503
        return not (is_probe and self.state.tokenizer_manager is None and self.state.startup_error is None)


KEEP_ALIVE_S = 65  # idle HTTP keep-alive, seconds (uvicorn's default, 5, equals common clients' pool expiry)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), before anything else starts; OSError naming the flags to change."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise OSError(f"--host {host!r} is not an address of this machine ({e.strerror}); use e.g. 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {e.strerror}; stop what serves there or choose another --port"
        ) from None
    return sock


def run_server(args: ServerArgs, model_path: str) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0, SIGTERM after draining) or until the engine dies (exit code 1).
    A port that cannot be bound: exit code 1 with the reason, before the engine starts."""
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    args.port = sock.getsockname()[1]  # --port 0: the one the system chose, in every line and in server info
    app = create_app(args, model_path)
    # Idle keep-alive connections stay open longer than clients keep them (httpx: 5 s), so a client never sends a
    # request on a connection the server is closing at that moment (the request would fail with a dropped read).
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=protocol_with_header_timeout(args.request_header_timeout),
    )
    state: ServerState = app.state.server
    server = DrainingServer(config, state)

    def request_exit(code: int) -> None:
        state.exit_code = code
        server.should_exit = True

    state.request_exit = request_exit
    state.is_exiting = lambda: server.should_exit
    logging.getLogger("uvicorn.access").addFilter(StartupProbeFilter(state))
    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers swallow that
    # re-raise so that a clean SIGINT/SIGTERM shutdown exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    print(
        f"sgl_jax_lora listening on http://{args.host}:{args.port} (engine starting; GET /health turns 200 when ready)",
        flush=True,
    )
    if args.model_path is None:
        print(
            f"no --model-path given: serving the embedded demo model ({model_path}), a tiny chat model trained on "
            "a small corpus (see README); pass --model-path DIR to serve a real model",
            flush=True,
        )
    server.run(sockets=[sock])
    _stop_engine_if_still_up(state)
    if not server.started and state.exit_code == 0:
        return 1  # uvicorn could not start (it logged why)
    return state.exit_code


def _stop_engine_if_still_up(state: ServerState) -> None:
    """The lifespan's shutdown stops the engine, but uvicorn skips it on a second SIGINT (its forced exit): then the
    engine process, waiting on a pipe this process still holds, and Python's join of it at exit would wait for each
    other for ever. Stop it here (once the lifespan ran, the engine is stopped already and this does nothing)."""
    if state.tokenizer_manager is not None:
        state.tokenizer_manager.shutdown()
    _stop_unfinished_children()
