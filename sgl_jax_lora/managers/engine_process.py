"""The engine process: builds EngineCore, then loops: read messages, run a step, send outputs.

Flow: EngineClient (managers/engine_client.py) spawns `run_engine_process` with one end of a Pipe and the
tokenizer's EOS id as the frontend read it, so this process never loads the tokenizer or imports transformers (with
--nnodes > 1 it first joins the other nodes: distributed/runtime.py). The process answers Ready (or StartupError),
then `EngineLoop` reads the typed messages of io_struct.py and dispatches on their class: GenerateRequest ->
`EngineCore.add_request` (RequestFailed if it can never fit), AbortRequest -> `EngineCore.abort`, an EngineCall
(server info, the prefix cache's flush, LoRA load/unload; a trace's start and stop, which go to the loop's
StepProfiler, managers/step_profiler.py) -> the method of `EngineLoop.calls`, answered with a CallReply (a LoRA
load from a directory first has its header checked on a worker thread, `EngineLoop._check_ahead`, and is answered
when that is done, so a burst of first-use adapters does not stall the steps), ShutdownRequest -> exit. Before the
loop the process freezes its startup objects out of the garbage collector's generations (utils/gc_freeze.py). Each step's EngineOutput items go back as one EngineOutputs. Every message to the
frontend goes through `Outbox`, a thread that encodes and writes them in order, so a step never waits for the
frontend to read the pipe. When idle the loop blocks on the pipe; when the frontend goes away (EOF) it exits. A
failing step fails only the requests of that step; the loop keeps serving the others.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from sgl_jax_lora.distributed.runtime import DistributedEngineError
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import parse_peft_config
from sgl_jax_lora.managers.io_struct import (
    AbortRequest,
    CacheFlushed,
    CallReply,
    EngineCall,
    EngineOutput,
    EngineOutputs,
    FlushCacheCall,
    GenerateRequest,
    LoadLoRACall,
    LoadLoRATensorsCall,
    Message,
    Ready,
    RequestFailed,
    ServerInfoCall,
    ShutdownRequest,
    StartProfileCall,
    StartupError,
    StopProfileCall,
    UnknownMessageError,
    UnloadLoRACall,
    decode,
    encode,
)
from sgl_jax_lora.managers.step_profiler import StepProfiler
from sgl_jax_lora.model_executor.compiler_options import enable_compilation_cache
from sgl_jax_lora.server_args import ServerArgs
from sgl_jax_lora.server_args_checks import sizes_set
from sgl_jax_lora.utils.gc_freeze import freeze_startup_objects
from sgl_jax_lora.utils.parent_watch import exit_when_parent_dies
from sgl_jax_lora.utils.quiet import quiet_platform_probes, skip_tpu_probe_without_chips

if TYPE_CHECKING:
    from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


def run_engine_process(args_dict: dict, model_path: str, conn: Connection, tokenizer_eos: tuple[int, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the frontend shuts us down
    exit_when_parent_dies()  # a SIGKILLed frontend leaves no engine behind, even one still starting
    quiet_platform_probes(args_dict.get("log_level", "info"))  # before JAX picks its platform
    skip_tpu_probe_without_chips(args_dict.get("log_level", "info"))
    logging.basicConfig(level=args_dict.get("log_level", "info").upper(), format="[engine %(process)d] %(message)s")
    enable_compilation_cache(args_dict.get("compilation_cache_dir"))
    from safetensors import SafetensorError

    refusals = (ValueError, OSError, MemoryError, SafetensorError)
    try:
        args = ServerArgs(**args_dict)
        if args.nnodes > 1:  # node 0 of a multi-host engine: join the other nodes before touching a device
            from sgl_jax_lora.distributed.runtime import initialize

            initialize(args)
        from sgl_jax_lora.managers.engine_core import EngineCore

        core = EngineCore(args, model_path, tokenizer_eos)
    except Exception as e:  # startup errors go back to the frontend, which raises them
        message = f"{type(e).__name__}: {e}"
        sizes = sizes_set(args_dict) if isinstance(e, MemoryError) else ""
        if sizes:
            message += f" (sizes set: {sizes}; lower them)"
        # a refusal (a setting, a model or adapter file, memory) is reported by the frontend's line alone; anything
        # else also logs its traceback here, the one process that has it
        if not isinstance(e, refusals):
            logger.exception("engine failed to start")
        conn.send_bytes(encode(StartupError(message)))
        return
    freeze_startup_objects()  # a full collection while serving then walks only the requests' objects
    conn.send_bytes(encode(Ready(info=core.server_info(), pid=os.getpid())))
    # A service manager's stop signals the whole group: the frontend drains and then shuts us down, so SIGTERM must
    # not end the engine under its running requests (or print libtpu's crash dump); a dead frontend closes the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    EngineLoop(core, conn, StepProfiler(args.profile_dir)).run()
    core.runner.close()  # multi-host: the other nodes exit too (after a failure they notice node 0's death instead)


IDLE_STEP_WAIT_S = 0.002


MAX_PENDING_MESSAGES = 256  # messages the frontend may lag behind before the loop waits for it (backpressure)


class Outbox:
    """Messages to the frontend, encoded and written in order by a thread of their own: a step's outputs are handed
    over and the loop goes on to the next step, while the write waits for the frontend to read (a message larger than
    the pipe's buffer waits until the frontend has read most of it). Only a frontend MAX_PENDING_MESSAGES messages
    behind makes `put` wait. A write that fails (the frontend is gone) drops the rest; the loop sees the end of the
    pipe on its next read. `close` sends what is queued, then stops."""

    _STOP = object()

    def __init__(self, conn: Connection, max_pending: int = MAX_PENDING_MESSAGES):
        self.conn = conn
        self.pending: queue.Queue = queue.Queue(max_pending)
        self.thread = threading.Thread(target=self._write_loop, name="engine-outbox", daemon=True)
        self.thread.start()

    def put(self, msg: Message) -> None:
        self.pending.put(msg)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop; a frontend that reads nothing for `timeout` seconds is given up on (what
        is still queued goes with the process). Called by the thread that puts, after its last put."""
        deadline = time.monotonic() + timeout
        try:
            self.pending.put(self._STOP, timeout=timeout)
            self.thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self.thread.is_alive():
            logger.warning("the frontend read nothing for %.1f s: the messages still queued are dropped", timeout)

    def _write_loop(self) -> None:
        while (msg := self.pending.get()) is not self._STOP:
            try:
                data = encode(msg)
            except Exception:  # a message that cannot be encoded is a bug: logged, the others still go
                logger.exception("a %s message could not be encoded and is dropped", type(msg).__name__)
                continue
            try:
                self.conn.send_bytes(data)
            except (EOFError, OSError):
                logger.warning("the frontend is gone: %s and the messages after it are dropped", type(msg).__name__)
                while self.pending.get() is not self._STOP:
                    pass
                return


def flush_prefix_cache(cache: PrefixCache | None) -> int:
    """Free every cached page no request holds (the held ones stay, as their requests need them); -> pages freed."""
    return 0 if cache is None else cache.evict(cache.num_evictable)


class EngineLoop:
    def __init__(self, core, conn: Connection, profiler: StepProfiler | None = None):
        self.core = core
        self.conn = conn
        self.outbox = Outbox(conn)
        self.profiler = profiler or StepProfiler(None)  # traces of the steps on request (--profile-dir)
        self.running = True
        self.loads_ahead: list[tuple[EngineCall, Future]] = []  # LoRA loads whose check ahead is on its way
        self.handlers = {
            GenerateRequest: self._generate,
            AbortRequest: self._abort,
            ShutdownRequest: self._shutdown,
        }
        # each call's EngineCore method; its result (plain data) is the CallReply's
        self.calls = {
            ServerInfoCall: lambda call: core.rpc_server_info(),
            FlushCacheCall: lambda call: CacheFlushed(flush_prefix_cache(core.prefix_cache)),
            LoadLoRACall: lambda call, summary=None: core.rpc_load_lora(
                call.lora_id, call.lora_name, call.lora_path, call.pinned, call.confined, summary
            ),
            LoadLoRATensorsCall: lambda call: core.rpc_load_lora_tensors(
                call.ref,
                call.tensors_paths,
                call.config,
                replaces=call.replaces,
                checked_finite=call.tensors_checked_finite,
            ),
            UnloadLoRACall: lambda call: core.rpc_unload_lora(call.lora_id),
            StartProfileCall: lambda call: self.profiler.start(call.num_steps),
            StopProfileCall: lambda call: self.profiler.stop(),
        }

    def run(self) -> None:
        try:
            self._serve()
        finally:
            if self.profiler.is_running:  # a trace running at shutdown is written, not lost
                try:
                    self.profiler.stop()
                except Exception:  # the outputs below still reach the frontend
                    logger.exception("writing the running trace at shutdown failed")
            self.outbox.close()  # what the last steps and calls sent reaches the frontend before the process ends

    def _serve(self) -> None:
        while self.running:
            try:
                self._drain(*self._message_wait())
            except (EOFError, OSError):
                return  # the frontend is gone
            if not self.running:
                return
            self._finish_loads_ahead()
            launched = self.core.num_steps_launched
            outputs = self._step()
            if self.core.num_steps_launched != launched:  # a step ran (not one that found nothing to run)
                self.profiler.step_done()
            if outputs:
                self._send(EngineOutputs(outputs))
            for rid, message in self.core.pop_request_errors():
                self._send(RequestFailed(rid, message))

    def _message_wait(self) -> tuple[bool, float]:
        """(block, timeout) of the next read of messages: idle, block for one; a step that found nothing to run (its
        requests wait for a prefetch or pages), or no request but a load whose header check is on its way, waits
        IDLE_STEP_WAIT_S; with requests to run, none (a pending check never holds up their steps)."""
        active = self.core.scheduler.num_active > 0
        if not active and not self.loads_ahead:
            return True, 0.0
        return False, IDLE_STEP_WAIT_S if self.core.last_step_idle or not active else 0.0

    def _step(self) -> list[EngineOutput]:
        try:
            return self.core.step()
        except DistributedEngineError:
            raise  # multi-host: the nodes are out of lockstep; the engine exits and the frontend fails its requests
        except Exception as e:  # fail the step's requests, keep serving
            logger.exception("step failed")
            return self.core.fail_running(f"engine error: {type(e).__name__}: {e}")

    def _drain(self, block: bool, timeout: float = 0) -> None:
        while self.conn.poll(None if block else timeout):
            data = self.conn.recv_bytes()
            try:
                msg = decode(data)
            except UnknownMessageError as e:  # a frontend of another version: refuse it, keep serving
                logger.error("dropped a message from the frontend: %s", e)
            else:
                self.handle(msg)
            block, timeout = False, 0

    def handle(self, msg: Message) -> None:
        """Dispatch one message from the frontend on its class. A LoRA load from a directory is answered once its
        header check, started here on a worker thread, is done (`_finish_loads_ahead`); steps go on meanwhile."""
        if isinstance(msg, (LoadLoRACall, LoadLoRATensorsCall)):
            try:
                ahead = self._check_ahead(msg)
            except Exception:  # the call runs whole below, which answers its error
                ahead = None
            if ahead is not None:
                self.loads_ahead.append((msg, ahead))
                return
        if isinstance(msg, EngineCall):
            self._send(self._call(msg))
            return
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.error("dropped a %s message: the engine process does not take it", type(msg).__name__)
            return
        handler(msg)

    def _generate(self, request: GenerateRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:
            self._send(RequestFailed(request.rid, str(e)))

    def _abort(self, msg: AbortRequest) -> None:
        out = self.core.abort(msg.rid)
        if out is not None:
            self._send(EngineOutputs([out]))

    def _shutdown(self, msg: ShutdownRequest) -> None:
        self.running = False

    def _check_ahead(self, call: LoadLoRACall | LoadLoRATensorsCall) -> Future | None:
        """The header check of a load's adapter, or a tensors load's config with regular expressions of its own
        matched against the model, started on a worker thread (LoRAManager.inspect_ahead, run_ahead); None when the
        load runs whole on the loop: LoRA off (the call fails at once), a pinned adapter from a directory (its weights
        are read when it registers), a tensors load with nothing to match in a child process."""
        lora = self.core.lora
        if lora is None:
            return None
        if isinstance(call, LoadLoRATensorsCall):
            if call.config is None or not parse_peft_config(call.ref.lora_name, call.config).has_client_patterns:
                return None  # matched in process, or (an update keeping its config) found in module_settings' cache
            setup = self.core.lora_setup
            return lora.run_ahead(lambda: setup.match_config(call.ref.lora_name, call.config))
        if call.pinned:
            return None
        ref = LoRARef(call.lora_name, call.lora_path, lora_id=call.lora_id, confined=call.confined)
        return lora.inspect_ahead(ref)

    def _finish_loads_ahead(self) -> None:
        """Register the adapters whose header check is done, in the order their loads came, and answer each load
        (its error, if the check or the registration failed)."""
        done = []
        while self.loads_ahead and self.loads_ahead[0][1].done():
            done.append(self.loads_ahead.pop(0))
        load = self.calls[LoadLoRACall]
        for call, ahead in done:
            if isinstance(call, LoadLoRATensorsCall):  # its match is cached now (or its error is met again)
                self._send(self._call(call))
                continue
            self._send(self._reply(call, lambda call=call, ahead=ahead: load(call, ahead.result())))

    def _call(self, call: EngineCall) -> CallReply:
        """Synchronous calls from the frontend: server info, LoRA load/unload."""
        method = self.calls.get(type(call))
        if method is None:
            return CallReply(call.call_id, ok=False, message=f"unknown engine call {type(call).__name__}")
        return self._reply(call, lambda: method(call))

    @staticmethod
    def _reply(call: EngineCall, run) -> CallReply:
        """The CallReply of `run()`: its result as plain data, or its error's message."""
        try:
            result = run()
            plain = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result
            return CallReply(call.call_id, ok=True, result=plain)
        except Exception as e:
            return CallReply(call.call_id, ok=False, message=str(e))

    def _send(self, msg: Message) -> None:
        self.outbox.put(msg)
