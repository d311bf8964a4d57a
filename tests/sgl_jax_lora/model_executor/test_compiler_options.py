"""sgl_jax_lora/model_executor/compiler_options.py: concurrent GPU kernels for the forward unless disabled and XLA's
memory limit raised (GPU only), the two forward programs (XLA's Triton GEMM fusions or cuBLAS's GEMMs) and which a
batch takes, and the persistent compilation cache the engine process and multi-host followers turn on."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.base_gemm import BaseGemm
from sgl_jax_lora.model_executor import compiler_options
from sgl_jax_lora.model_executor.compiler_options import (
    ForwardPrograms,
    enable_compilation_cache,
    forward_compiler_options,
    takes_cublas_gemms,
)
from sgl_jax_lora.server_args import ServerArgs


def test_forward_compiler_options_turn_concurrent_kernels_on_only_on_gpu():
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    limit = {"xla_gpu_memory_limit_slop_factor": 100000}  # past the rematerialization's reach, with or without
    triton = dict(cublas_gemms=False)
    assert forward_compiler_options("gpu", False, **triton) == {**concurrent, **limit}
    assert forward_compiler_options("cuda", False, **triton) == {**concurrent, **limit}
    assert forward_compiler_options("gpu", True, **triton) == limit
    for platform in ("cpu", "tpu"):
        for cublas in (True, False):
            assert forward_compiler_options(platform, False, cublas_gemms=cublas) is None
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert not ServerArgs.from_cli_args(parser.parse_args([])).disable_gpu_concurrent_kernels
    assert ServerArgs.from_cli_args(
        parser.parse_args(["--disable-gpu-concurrent-kernels"])
    ).disable_gpu_concurrent_kernels


def test_cublas_gemms_are_the_option_for_xla_dots_on_gpu():
    """cublas_gemms: XLA's dots as cuBLAS GEMMs, with or without concurrent kernels; without it XLA's Triton GEMM
    fusions (its option left at XLA's default)."""
    cublas = {"xla_gpu_enable_triton_gemm": False}
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    limit = {"xla_gpu_memory_limit_slop_factor": 100000}
    assert forward_compiler_options("gpu", False, cublas_gemms=True) == {**concurrent, **limit, **cublas}
    assert forward_compiler_options("cuda", True, cublas_gemms=True) == {**limit, **cublas}
    assert "xla_gpu_enable_triton_gemm" not in forward_compiler_options("gpu", False, cublas_gemms=False)


class Batch(NamedTuple):
    x: jax.Array
    lora: jax.Array | None
    input_ids: jax.Array  # the token bucket's tokens


def test_a_batch_takes_cublas_without_adapters_and_in_the_kernels_buckets_that_keep_xla_dots():
    """Without adapters always; with adapters only in the base GEMM kernel's buckets that keep XLA's dots (the
    default setting of one Hopper GPU: the 256 bucket), not below the kernel's buckets (the SGMV kernels run beside
    XLA's Triton fusions there), nor in the buckets that run the kernel, nor without a base GEMM setting."""

    def batch(tokens: int, adapters: bool) -> Batch:
        return Batch(jnp.ones(2), jnp.zeros(2, jnp.int32) if adapters else None, jnp.zeros(tokens, jnp.int32))

    hopper_default = BaseGemm(256, skinny=True, xla_dots=True)
    for tokens in (64, 128, 256, 512, 4096):
        assert takes_cublas_gemms(batch(tokens, adapters=False), hopper_default)
        assert takes_cublas_gemms(batch(tokens, adapters=False), None)
    assert takes_cublas_gemms(batch(256, adapters=True), hopper_default)
    for tokens in (64, 128, 512, 4096):
        assert not takes_cublas_gemms(batch(tokens, adapters=True), hopper_default)
    assert not takes_cublas_gemms(batch(256, adapters=True), BaseGemm(256, skinny=True))  # the kernel runs there
    assert not takes_cublas_gemms(batch(256, adapters=True), None)


def test_forward_programs_pick_the_program_the_batch_takes(monkeypatch):
    """Two programs, compiled with XLA's Triton GEMM fusions and with cuBLAS's GEMMs; a batch with adapters outside
    the kernel's buckets that keep XLA's dots runs the first, one without adapters or inside them the second; both
    donate the KV cache and compute the same step."""
    asked = []

    def options(platform: str, disable_gpu_concurrent_kernels: bool, *, cublas_gemms: bool):
        asked.append((platform, disable_gpu_concurrent_kernels, cublas_gemms))
        return None  # this CPU compiles neither GPU option

    monkeypatch.setattr(compiler_options, "forward_compiler_options", options)
    step = lambda state, lora_state, kv, batch, prev: (batch.x * state + kv, kv + 1)  # noqa: E731
    programs = ForwardPrograms(step, "cpu", True, BaseGemm(256, skinny=True, xla_dots=True))
    assert asked == [("cpu", True, False), ("cpu", True, True)]
    adapters = jnp.zeros(2, jnp.int32)
    with_adapters = Batch(jnp.ones(2), adapters, jnp.zeros(128, jnp.int32))
    with_adapters_256 = Batch(jnp.ones(2), adapters, jnp.zeros(256, jnp.int32))
    without = Batch(jnp.ones(2), None, jnp.zeros(128, jnp.int32))
    assert programs.program(with_adapters) is programs.triton_gemms
    assert programs.program(with_adapters_256) is programs.cublas_gemms
    assert programs.program(without) is programs.cublas_gemms
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
