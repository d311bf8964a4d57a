"""sgl_jax_lora/distributed/runtime.py: each node autotunes its GPU programs alone (XLA's sharded autotuning off,
other XLA flags kept, a user's own setting wins); the mesh must span every device of every node; a follower waits
for node 0's coordinator and names its address when it does not answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from sgl_jax_lora.distributed.runtime import (
    DistributedEngineError,
    check_mesh_spans_all_devices,
    tune_each_node_alone,
    wait_for_coordinator,
)
from sgl_jax_lora.server_args import ServerArgs


def test_sharded_autotuning_is_turned_off_beside_the_other_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    tune_each_node_alone()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_gpu_shard_autotuning=false"


def test_without_xla_flags_the_setting_is_the_only_flag(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    tune_each_node_alone()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_shard_autotuning=false"


def test_a_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_shard_autotuning=true")
    tune_each_node_alone()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_shard_autotuning=true"


def test_a_mesh_smaller_than_all_devices_names_the_tp_size_to_set():
    args = ServerArgs(model_path="unused", tp_size=2, nnodes=2, node_rank=0, dist_init_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="set --tp-size 8"):
        check_mesh_spans_all_devices(args)  # this process sees the test suite's 8 fake devices


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follower_args(port: int, timeout: int = 1) -> ServerArgs:
    return ServerArgs(
        model_path="unused", nnodes=2, node_rank=1, dist_init_addr=f"127.0.0.1:{port}", dist_init_timeout=timeout
    )


def test_a_follower_names_node_0s_address_when_its_coordinator_does_not_answer():
    port = closed_port()
    start = time.monotonic()
    with pytest.raises(DistributedEngineError, match=rf"node 0's coordinator at 127.0.0.1:{port} did not answer"):
        wait_for_coordinator(follower_args(port), poll_s=0.1)
    assert time.monotonic() - start < 5  # within --dist-init-timeout (1 s) and a connect's time


def test_a_follower_goes_on_once_node_0_listens():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        wait_for_coordinator(follower_args(listener.getsockname()[1], timeout=10))


def test_a_follower_started_without_node_0_exits_1_naming_it():
    port, health_port = closed_port(), closed_port()
    result = subprocess.run(
        [sys.executable, "-m", "sgl_jax_lora.launch", "--nnodes", "2", "--node-rank", "1", "--port", str(health_port)]
        + ["--dist-init-addr", f"127.0.0.1:{port}", "--dist-init-timeout", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"node 0's coordinator at 127.0.0.1:{port} did not answer within --dist-init-timeout 2s" in result.stderr
    assert "Traceback" not in result.stderr and "Check failure" not in result.stderr


def test_node_0_whose_follower_never_joins_fails_its_start_naming_the_nodes_to_start():
    port, http_port = closed_port(), closed_port()
    result = subprocess.run(
        [sys.executable, "-m", "sgl_jax_lora.launch", "--nnodes", "2", "--port", str(http_port), "--skip-precompile"]
        + ["--dist-init-addr", f"127.0.0.1:{port}", "--dist-init-timeout", "2"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert (
        f"(exit code -6); with --nnodes 2, JAX aborts when not every node joins 127.0.0.1:{port} within "
        "--dist-init-timeout 2s: start nodes 1..1 with the same --nnodes and --dist-init-addr"
    ) in result.stderr
