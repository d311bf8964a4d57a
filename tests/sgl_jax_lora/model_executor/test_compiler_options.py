"""sgl_jax_lora/model_executor/compiler_options.py: concurrent GPU kernels for the forward unless disabled and XLA's
memory limit raised (GPU only), the two forward programs by kind of batch, and the persistent compilation cache the
engine process and multi-host followers turn on."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.model_executor import compiler_options
from sgl_jax_lora.model_executor.compiler_options import (
    ForwardPrograms,
    enable_compilation_cache,
    forward_compiler_options,
)
from sgl_jax_lora.server_args import ServerArgs


def test_forward_compiler_options_turn_concurrent_kernels_on_only_on_gpu():
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    limit = {"xla_gpu_memory_limit_slop_factor": 100000}  # past the rematerialization's reach, with or without
    with_lora = dict(with_lora=True)
    assert forward_compiler_options("gpu", False, **with_lora) == {**concurrent, **limit}
    assert forward_compiler_options("cuda", False, **with_lora) == {**concurrent, **limit}
    assert forward_compiler_options("gpu", True, **with_lora) == limit
    for platform in ("cpu", "tpu"):
        for lora in (True, False):
            assert forward_compiler_options(platform, False, with_lora=lora) is None
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert not ServerArgs.from_cli_args(parser.parse_args([])).disable_gpu_concurrent_kernels
    assert ServerArgs.from_cli_args(
        parser.parse_args(["--disable-gpu-concurrent-kernels"])
    ).disable_gpu_concurrent_kernels


def test_a_forward_without_adapters_takes_cublas_gemms_on_gpu():
    """XLA's dots of a LoRA-free forward are cuBLAS GEMMs, with or without concurrent kernels; a forward with adapters
    keeps XLA's Triton GEMM fusions (its option left at XLA's default)."""
    cublas = {"xla_gpu_enable_triton_gemm": False}
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    limit = {"xla_gpu_memory_limit_slop_factor": 100000}
    assert forward_compiler_options("gpu", False, with_lora=False) == {**concurrent, **limit, **cublas}
    assert forward_compiler_options("cuda", True, with_lora=False) == {**limit, **cublas}
    assert "xla_gpu_enable_triton_gemm" not in forward_compiler_options("gpu", False, with_lora=True)


class Batch(NamedTuple):
    x: jax.Array
    lora: jax.Array | None


def test_forward_programs_pick_the_lora_free_program_for_a_batch_without_adapters(monkeypatch):
    """Two programs, compiled with the options of a forward with adapters and without; a batch with an adapter batch
    runs the first, one without it the second; both donate the KV cache and compute the same step."""
    asked = []

    def options(platform: str, disable_gpu_concurrent_kernels: bool, *, with_lora: bool):
        asked.append((platform, disable_gpu_concurrent_kernels, with_lora))
        return None  # this CPU compiles neither GPU option

    monkeypatch.setattr(compiler_options, "forward_compiler_options", options)
    programs = ForwardPrograms(lambda state, lora_state, kv, batch, prev: (batch.x * state + kv, kv + 1), "cpu", True)
    assert asked == [("cpu", True, True), ("cpu", True, False)]
    with_adapters, without = Batch(jnp.ones(2), jnp.zeros(2, jnp.int32)), Batch(jnp.ones(2), None)
    assert programs.program(with_adapters) is programs.with_lora
    assert programs.program(without) is programs.without_lora
    for batch in (with_adapters, without):
        kv = jnp.full(2, 3.0)
        out, new_kv = programs(2.0, None, kv, batch, None)
        assert np.allclose(out, 5.0) and np.allclose(new_kv, 4.0) and kv.is_deleted()  # the cache donated
        assert programs.lower(2.0, None, new_kv, batch, None).compile() is not None


@pytest.fixture
def restore_cache_config():
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_the_compilation_cache_goes_where_the_flag_says_unless_the_environment_names_one(
    tmp_path, monkeypatch, restore_cache_config
):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    enable_compilation_cache(str(tmp_path / "xla"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # every program is cached
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    enable_compilation_cache(str(tmp_path / "other"))  # the environment wins: the setting stays as it was
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    enable_compilation_cache(None)  # no flag: nothing changes
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")


def test_a_cache_dir_that_cannot_be_created_leaves_the_cache_off_with_one_warning(
    tmp_path, monkeypatch, restore_cache_config, caplog
):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    enable_compilation_cache(str(tmp_path / "xla"))
    (tmp_path / "file").write_text("")
    enable_compilation_cache(str(tmp_path / "file" / "cache"))  # under a file: makedirs fails, even for root
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")  # unchanged
    assert [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()] == [
        f"--compilation-cache-dir {tmp_path / 'file' / 'cache'} cannot be written: compiling without the cache "
        "(restarts compile again); give a writable directory, or '' to turn it off"
    ]
