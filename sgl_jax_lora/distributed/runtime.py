"""Joining the JAX multi-controller runtime: the first thing a multi-host engine process does.

Flow: run_engine_process (node 0) or follower.run_follower (nodes 1..N-1) -> `initialize(args)`: each node's own GPU
autotuning (`tune_each_node_alone`), SIGTERM left to end the process (JAX's preemption service off), gloo
collectives on CPU, nodes 1..N-1 waiting for node 0's coordinator to listen (`wait_for_coordinator`),
`jax.distributed.initialize` with the coordinator at --dist-init-addr (node 0 hosts it),
heartbeats that make every node exit within about --dist-heartbeat-timeout seconds of another's death ->
`check_mesh_spans_all_devices`.
"""

from __future__ import annotations

import json
import os
import socket
import time

from sgl_jax_lora.server_args import ServerArgs


class DistributedEngineError(RuntimeError):
    """A device action of a multi-host engine failed: the nodes are out of lockstep and must all restart."""


def initialize(args: ServerArgs) -> None:
    """Join the other nodes (blocks until all --nnodes have joined, up to --dist-init-timeout seconds)."""
    import jax  # here, not at the top: the frontend imports this module's error and never imports JAX

    tune_each_node_alone()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives across processes
    # JAX's preemption service catches SIGTERM (to reach a sync point that only training loops ask for): a node
    # would keep running when an operator or a supervisor stops it. Off, SIGTERM ends the node; the others follow
    # within --dist-heartbeat-timeout.
    jax.config.update("jax_enable_preemption_service", False)
    if args.node_rank > 0:  # JAX aborts the process (no Python error) when it cannot reach the coordinator in time
        wait_for_coordinator(args)
    try:
        jax.distributed.initialize(
            coordinator_address=args.dist_init_addr,
            num_processes=args.nnodes,
            process_id=args.node_rank,
            initialization_timeout=args.dist_init_timeout,
            heartbeat_timeout_seconds=args.dist_heartbeat_timeout,
            shutdown_timeout_seconds=args.dist_heartbeat_timeout,  # a node exiting after another died does not wait long
        )
    except Exception as e:
        raise DistributedEngineError(
            f"node {args.node_rank} of {args.nnodes} could not join the coordinator at {args.dist_init_addr} ({e}); "
            "start every node with the same --nnodes and --dist-init-addr (node 0's address, a port free there) and a "
            "distinct --node-rank, within --dist-init-timeout seconds of each other"
        ) from e
    check_mesh_spans_all_devices(args)


def wait_for_coordinator(args: ServerArgs, poll_s: float = 0.5) -> None:
    """Wait (up to --dist-init-timeout seconds) until node 0's coordination service accepts connections at
    --dist-init-addr, so that a follower started without node 0, or given a wrong address, fails with a message
    naming it rather than in JAX's abort."""
    host, _, port = args.dist_init_addr.rpartition(":")
    host = host.strip("[]")  # [::1]:PORT
    deadline = time.monotonic() + args.dist_init_timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, args.dist_init_timeout)):
                return
        except OSError as e:
            if time.monotonic() + poll_s > deadline:
                raise DistributedEngineError(
                    f"node {args.node_rank} of {args.nnodes}: node 0's coordinator at {args.dist_init_addr} did not "
                    f"answer within --dist-init-timeout {args.dist_init_timeout}s ({e.strerror or e}); start node 0 "
                    "(--node-rank 0) with the same --nnodes and --dist-init-addr, or fix the address"
                ) from None
        time.sleep(poll_s)


def tune_each_node_alone() -> None:
    """Turn off XLA's sharded GPU autotuning (unless XLA_FLAGS sets it): with it, each process tunes a share of the
    GEMMs of every program it compiles and waits for the other processes' shares. Our nodes compile on several
    threads, in orders that can differ, and each reads its own persistent compilation cache, so a node could wait
    for a share that no other node will tune. Called before the GPU backend starts (XLA reads its flags once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_shard_autotuning" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_shard_autotuning=false".strip()


def check_mesh_spans_all_devices(args: ServerArgs) -> None:
    """Multi-host serving shards the model over every device of every node (one 'tensor' axis)."""
    import jax

    total = jax.device_count()
    if args.tp_size != total:
        raise ValueError(
            f"--tp-size {args.tp_size} but the {args.nnodes} nodes have {total} devices in all "
            f"({jax.local_device_count()} on this node); multi-host serving uses every device: set --tp-size {total}"
        )


def coordination_client():
    """The distributed runtime's client (the key-value store of the coordination service node 0 hosts)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized; call runtime.initialize(args) first")
    return client


def read_model_config(model_path: str) -> dict:
    """The model's config.json, which every node must have the same of."""
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        return json.load(f)
