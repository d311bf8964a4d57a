"""EngineClient: the frontend's end of the engine process: spawns it, owns its pipe, routes what comes back.

Flow: TokenizerManager builds one EngineClient, which spawns `run_engine_process` (managers/engine_process.py) and
blocks until the engine answers Ready (its server info) or StartupError (raised here as RuntimeError; a process that
dies first raises EngineDeadError). The engine process reports its own startup progress (compilation) on stderr.
`start(loop)` starts the reader thread: each message from the engine (io_struct.py) is dispatched on its class in
`loop` -- EngineOutputs items and RequestFailed go to the queue of their request (`open_stream`), a CallReply to
the future of its `call`. When the pipe closes every open stream gets EngineDeadError and every pending call fails
with it. `send` writes any frontend message (GenerateRequest, AbortRequest, ...); `shutdown` stops the process.
This process never imports JAX.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable

from sgl_jax_lora.managers.engine_process import run_engine_process
from sgl_jax_lora.managers.io_struct import (
    AbortRequest,
    CallReply,
    EngineCall,
    EngineOutputs,
    Message,
    Ready,
    RequestFailed,
    ShutdownRequest,
    StartupError,
    UnsendableValueError,
    decode,
    encode,
)
from sgl_jax_lora.server_args import ServerArgs
from sgl_jax_lora.server_args_checks import sizes_set

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request was refused (bad input, or the engine could not serve it)."""


class EngineDeadError(RuntimeError):
    """The engine process exited."""


class EngineStartupError(RuntimeError):
    """The engine process reported that it could not start; `reason` is its error, as "Type: message"."""

    def __init__(self, reason: str):
        super().__init__(f"engine failed to start: {reason}")
        self.reason = reason


class ServerBusyError(RuntimeError):
    """A request was refused because the server already holds as many as --max-queued-requests allows."""


def startup_death_hint(exit_code: int | None, args: ServerArgs) -> str:
    """What an engine process that died without a word during startup most likely met: the kernel's OOM killer
    (SIGKILL), or, for a multi-host engine, JAX's abort when the nodes did not all join in time (SIGABRT)."""
    if exit_code == -signal.SIGKILL:
        sizes = sizes_set(args.to_dict())
        return f"; killed by SIGKILL: out of host memory? (lower the sizes it allocates{': ' + sizes if sizes else ''})"
    if exit_code == -signal.SIGABRT and args.nnodes > 1:
        return (
            f"; with --nnodes {args.nnodes}, JAX aborts when not every node joins {args.dist_init_addr} within "
            f"--dist-init-timeout {args.dist_init_timeout}s: start nodes 1..{args.nnodes - 1} with the same --nnodes "
            "and --dist-init-addr (its messages above say more)"
        )
    return ""


class EngineClient:
    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        tokenizer_eos: tuple[int, ...],
        target: Callable = run_engine_process,
    ):
        """Spawn `target(args_dict, model_path, conn, tokenizer_eos)` (the engine process; tests give a
        stand-in) and wait for it to be ready. `tokenizer_eos`: the frontend's tokenizer's EOS id
        (managers/stop_checker.py), so that the engine process need not load the tokenizer."""
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        spawn_args = (args.to_dict(), model_path, child_conn, tokenizer_eos)
        self.process = context.Process(target=target, args=spawn_args, daemon=True)
        self.process.start()
        child_conn.close()
        try:
            ready = self._wait_ready(args)
        except BaseException:  # an interrupt (Ctrl-C) or a failed start: no engine process outlives its client
            self._stop_process()
            raise
        self.server_info: dict = ready.info  # as the engine reported it at startup
        self.is_dead = False
        self._streams: dict[str, asyncio.Queue] = {}  # engine increments of each running request, by rid
        self._unfinished: set[str] = set()  # rids of open streams whose request the engine has not finished
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self.handlers = {EngineOutputs: self._on_outputs, RequestFailed: self._on_failed, CallReply: self._on_reply}
        self._message_waiters: list[asyncio.Future] = []  # `next_message` callers, resolved by the next message

    def _wait_ready(self, args: ServerArgs) -> Ready:
        try:
            msg = decode(self._conn.recv_bytes())
        except EOFError:
            self.process.join(timeout=5)
            code = self.process.exitcode
            raise EngineDeadError(
                f"engine process exited during startup (exit code {code}){startup_death_hint(code, args)}"
            ) from None
        if isinstance(msg, StartupError):
            self.process.join(timeout=10)
            raise EngineStartupError(msg.message)
        if not isinstance(msg, Ready):
            raise RuntimeError(f"engine failed to start: it sent {type(msg).__name__} before Ready")
        return msg

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin routing engine messages into `loop` (call once, from or for the serving loop)."""
        self._loop = loop
        threading.Thread(target=self._read_loop, name="engine-reader", daemon=True).start()

    # ---- engine -> frontend ------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                msg = decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._call_in_loop(self._on_engine_death)
                return
            if not self._call_in_loop(self.dispatch, msg):
                return

    def _call_in_loop(self, fn: Callable, *args: object) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the serving loop is closed: nobody is left to route to
            return False
        return True

    def dispatch(self, msg: Message) -> None:
        """Route one engine message (on the loop); a message the frontend does not take is logged and dropped."""
        for waiter in self._message_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._message_waiters.clear()
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.error("the engine sent a %s message, which the frontend does not take", type(msg).__name__)
            return
        handler(msg)

    def _on_outputs(self, msg: EngineOutputs) -> None:
        for item in msg.items:
            queue = self._streams.get(item.rid)
            if queue is not None:
                queue.put_nowait(item)
                if item.finish_reason is not None:
                    self._unfinished.discard(item.rid)

    def _on_failed(self, msg: RequestFailed) -> None:
        queue = self._streams.get(msg.rid)
        if queue is not None:
            queue.put_nowait(RequestError(msg.message))
            self._unfinished.discard(msg.rid)

    def _on_reply(self, msg: CallReply) -> None:
        future = self._calls.pop(msg.call_id, None)
        if future is not None and not future.done():
            future.set_result(msg)

    def _on_engine_death(self) -> None:
        self.is_dead = True
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError("engine process exited"))
        for future in [*self._calls.values(), *self._message_waiters]:
            if not future.done():
                future.set_exception(EngineDeadError("engine process exited"))

    def next_message(self) -> asyncio.Future:
        """A future that completes when the engine sends its next message, whatever it is (the engine's loop is
        alive: GET /health_generate). Call on the serving loop."""
        waiter = asyncio.get_running_loop().create_future()
        self._message_waiters.append(waiter)
        return waiter

    # ---- frontend -> engine ------------------------------------------------------------------
    def open_stream(self, rid: str) -> asyncio.Queue:
        """The queue that receives request `rid`'s EngineOutput items (or the exception that ends it)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        self._unfinished.add(rid)
        return queue

    def close_stream(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._unfinished.discard(rid)

    def has_stream(self, rid: str) -> bool:
        """Whether request `rid` is running: sent, and its stream not closed."""
        return rid in self._streams

    @property
    def num_unfinished(self) -> int:
        """Requests sent that the engine has not finished (a finished one whose reader has not taken its last
        result keeps its stream open, but holds nothing of the engine's)."""
        return len(self._unfinished)

    def send(self, msg: Message) -> None:
        if self.is_dead:
            raise EngineDeadError("engine process exited")
        try:
            data = encode(msg)
        except UnsendableValueError as e:  # a client's value past 64 bits: the request's fault, not the server's
            raise RequestError(str(e)) from None
        with self._send_lock:
            self._conn.send_bytes(data)

    async def call(self, call: EngineCall) -> object:
        """A synchronous request to the engine process (server info, LoRA load/unload) -> its result;
        RequestError with the engine's message if it failed."""
        call.call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call.call_id] = future
        try:
            self.send(call)
        except BaseException:
            self._calls.pop(call.call_id, None)
            raise
        reply: CallReply = await future
        if not reply.ok:
            raise RequestError(reply.message)
        return call.REPLY(**reply.result) if call.REPLY is not None else reply.result

    def abort(self, rid: str) -> None:
        self.send(AbortRequest(rid))

    def shutdown(self) -> None:
        if self.process.is_alive():
            try:
                self.send(ShutdownRequest())
            except (EngineDeadError, OSError):
                pass
            self.process.join(timeout=10)
        self._stop_process()

    def _stop_process(self) -> None:
        """Terminate the engine process if it still runs (then kill it), and close the pipe."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self._conn.close()
