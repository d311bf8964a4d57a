"""A follower node (--node-rank > 0): replays node 0's device actions; serves /health only.

Flow: `python -m sgl_jax_lora.launch --nnodes N --node-rank R --dist-init-addr HOST:PORT` -> launch.main ->
`run_follower`: /health on --host:--port (503 while starting, 200 once node 0's warmup is replayed) -> join the
runtime (runtime.initialize) -> Hello: node 0's settings; this node checks that its checkpoint has the same config.json,
builds the same ModelRunner (ReplicaModelRunner) on its own devices -> `Follower.run`: every command in order, each
calling the same compiled program as node 0 with the same inputs (a receiver thread fetches and decodes the next
commands while this node dispatches the current one) -> Shutdown: exit 0. Any error, a lost node 0
included, exits non-zero (node 0 then fails within --dist-heartbeat-timeout seconds).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading

import jax

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.distributed import runtime
from sgl_jax_lora.distributed.channel import CommandChannel
from sgl_jax_lora.distributed.commands import (
    Command,
    Forward,
    Hello,
    Logits,
    Precompile,
    PromptLogprobs,
    Ready,
    Sample,
    Shutdown,
    WriteLoRASlot,
    decode,
)
from sgl_jax_lora.distributed.leader_runner import RECENT_SAMPLES
from sgl_jax_lora.distributed.replica_runner import ReplicaModelRunner
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.model_executor.compile_counter import CompileCounter
from sgl_jax_lora.model_executor.compiler_options import enable_compilation_cache
from sgl_jax_lora.model_executor.padding_batches import warmup_compile_threads
from sgl_jax_lora.server_args import ServerArgs
from sgl_jax_lora.utils.gc_freeze import freeze_startup_objects
from sgl_jax_lora.utils.quiet import skip_tpu_probe_without_chips

logger = logging.getLogger(__name__)
RECEIVE_AHEAD = 64  # commands received and decoded ahead of the one being replayed


@dataclasses.dataclass
class FollowerStatus:
    """What /health reports on a follower."""

    node_rank: int
    is_ready: bool = False
    num_commands: int = 0
    num_compilations: int = 0
    num_compilations_at_ready: int = 0


class Follower:
    def __init__(self, args: ServerArgs, model_path: str, channel: CommandChannel, status: FollowerStatus):
        self.channel, self.status = channel, status
        self.compile_counter = CompileCounter()
        hello = decode(self.channel.receive())
        if not isinstance(hello, Hello):
            raise RuntimeError(f"node {args.node_rank}: expected node 0's settings first, got {type(hello).__name__}")
        if runtime.read_model_config(model_path) != hello.model_config:
            raise ValueError(
                f"node {args.node_rank}: --model-path {model_path} has another config.json than node 0's "
                "model; give every node the same checkpoint"
            )
        leader_args = ServerArgs(**{**hello.args, "model_path": model_path, "node_rank": args.node_rank})
        cfg = ModelConfig.from_model_path(model_path)
        mesh = make_mesh(leader_args.tp_size)
        from sgl_jax_lora.lora.lora_setup import (
            LoRASetup,  # only with LoRA: reads no adapter (tensors come as commands)
        )

        spec = LoRASetup(leader_args, model_path, mesh).spec if leader_args.enable_lora else None
        buckets = Buckets(**{k: tuple(v) if isinstance(v, list) else v for k, v in hello.buckets.items()})
        self.runner = ReplicaModelRunner(leader_args, cfg, mesh, buckets, spec, channel)
        self.latest_forward: tuple[jax.Array, jax.Array] | None = None
        self.latest_logits: jax.Array | None = None
        self.carried_ids: dict[int, jax.Array] = {}
        self.handlers = {
            Precompile: self._precompile,
            Forward: self._forward,
            PromptLogprobs: self._prompt_logprobs,
            Logits: self._logits,
            Sample: self._sample,
            WriteLoRASlot: self._write_lora_slot,
            Ready: self._ready,
        }
        self.status.is_ready = leader_args.skip_precompile  # else once node 0's warmup is replayed (Ready)
        self.threads = warmup_compile_threads(leader_args.warmup_compile_threads)

    def run(self) -> None:
        """Replay commands until node 0 sends Shutdown."""
        inbox: queue.Queue[Command | Exception] = queue.Queue(maxsize=RECEIVE_AHEAD)
        threading.Thread(target=self._receive_ahead, args=(inbox,), name="command-receiver", daemon=True).start()
        while True:
            command = inbox.get()
            if isinstance(command, Exception):
                raise command
            self.status.num_commands += 1
            self.status.num_compilations = self.compile_counter.count
            if isinstance(command, Shutdown):
                return
            handler = self.handlers.get(type(command))
            if handler is None:
                raise RuntimeError(f"node {self.channel.node_rank}: unexpected command {type(command).__name__}")
            handler(command)

    def _receive_ahead(self, inbox: queue.Queue) -> None:
        """The receiver thread: each command in order (a failure, node 0's loss included, ends the replay)."""
        while True:
            try:
                command = decode(self.channel.receive())
            except Exception as e:
                inbox.put(e)
                return
            inbox.put(command)
            if isinstance(command, Shutdown):
                return

    def _precompile(self, command: Precompile) -> None:
        self.runner.precompile_forwards(command.batches, self.threads)

    def _forward(self, command: Forward) -> None:
        prev_ids = self.carried_ids[command.prev_sample] if command.prev_sample >= 0 else None
        self.latest_forward = self.runner.forward(command.batch, prev_ids)

    def _prompt_logprobs(self, command: PromptLogprobs) -> None:
        self.runner.prompt_logprobs(self.latest_forward[0], command.targets, command.num_top)

    def _logits(self, command: Logits) -> None:
        prev_ids = self.carried_ids[command.prev_sample] if command.prev_sample >= 0 else self.runner.no_prev_ids
        self.latest_logits = self.runner.logits(self.latest_forward[1], command.adjustments, prev_ids)

    def _sample(self, command: Sample) -> None:
        launched = self.runner.sample_logits(self.latest_logits, command.sampling)
        self.carried_ids[command.seq] = launched.carried_ids
        self.carried_ids.pop(command.seq - RECENT_SAMPLES, None)

    def _write_lora_slot(self, command: WriteLoRASlot) -> None:
        self.runner.write_lora_slot(command.slot, command.values)

    def _ready(self, command: Ready) -> None:
        self.status.num_compilations_at_ready = self.compile_counter.count
        self.status.is_ready = True
        freeze_startup_objects()  # as node 0's engine process does before its loop (utils/gc_freeze.py)


def run_follower(args: ServerArgs, model_path: str) -> int:
    """Serve /health, join the runtime, replay node 0 until it shuts down (0) or something fails (1)."""
    status = FollowerStatus(args.node_rank)
    _start_health_server(args, status)
    print(
        f"sgl_jax_lora node {args.node_rank}/{args.nnodes}: joining {args.dist_init_addr}; GET "
        f"http://{args.host}:{args.port}/health turns 200 when node 0's warmup is replayed",
        flush=True,
    )
    enable_compilation_cache(args.compilation_cache_dir)  # this node's own flag: restarts skip compiling
    skip_tpu_probe_without_chips(args.log_level)
    try:
        runtime.initialize(args)
        channel = CommandChannel(args.node_rank, args.nnodes)
        Follower(args, model_path, channel, status).run()
    except Exception as e:
        logger.error("node %d: %s: %s; exiting", args.node_rank, type(e).__name__, e)
        return 1
    logger.info("node %d: node 0 shut down; exiting", args.node_rank)
    return 0


def _start_health_server(args: ServerArgs, status: FollowerStatus) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from sgl_jax_lora.entrypoints.errors import install_error_handlers

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, on_error=lambda request, error: None)  # a 404 in the server's error body

    @app.get("/health", response_model=None)
    def health():  # no return annotation: a string naming a local import would break the route schema (404 listing)
        body = {
            "status": "ok" if status.is_ready else "starting",
            "node_rank": status.node_rank,
            "num_commands": status.num_commands,
            "num_compilations": status.num_compilations,
            # counted from the replayed warmup's end: none before it
            "num_compilations_after_warmup": (
                status.num_compilations - status.num_compilations_at_ready if status.is_ready else None
            ),
        }
        return JSONResponse(body, status_code=200 if status.is_ready else 503)

    from sgl_jax_lora.entrypoints.header_timeout import protocol_with_header_timeout

    http = protocol_with_header_timeout(args.request_header_timeout)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=http))
    threading.Thread(target=server.run, name="health", daemon=True).start()
