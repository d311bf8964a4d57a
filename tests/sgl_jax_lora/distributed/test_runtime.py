"""sgl_jax_lora/distributed/runtime.py: each node autotunes its GPU programs alone (XLA's sharded autotuning off,
other XLA flags kept, a user's own setting wins); the mesh must span every device of every node."""

from __future__ import annotations

import os

import pytest

from sgl_jax_lora.distributed.runtime import check_mesh_spans_all_devices, tune_each_node_alone
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
