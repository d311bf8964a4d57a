"""sgl_jax_lora/model_executor/compiler_options.py: concurrent GPU kernels for the forward unless disabled (GPU only),
and the persistent compilation cache the engine process and multi-host followers turn on."""

from __future__ import annotations

import argparse

import jax
import pytest

from sgl_jax_lora.model_executor.compiler_options import enable_compilation_cache, forward_compiler_options
from sgl_jax_lora.server_args import ServerArgs


def test_forward_compiler_options_turn_concurrent_kernels_on_only_on_gpu():
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert forward_compiler_options("gpu", False) == forward_compiler_options("cuda", False) == concurrent
    assert forward_compiler_options("gpu", True) is None
    assert forward_compiler_options("cpu", False) is None and forward_compiler_options("tpu", False) is None
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert not ServerArgs.from_cli_args(parser.parse_args([])).disable_gpu_concurrent_kernels
    assert ServerArgs.from_cli_args(
        parser.parse_args(["--disable-gpu-concurrent-kernels"])
    ).disable_gpu_concurrent_kernels


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
