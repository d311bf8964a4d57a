"""Test setup, before any test imports jax: 8 fake CPU devices for the sharding tests, and the platform JAX runs on;
temporary files under pytest's base temp (`session_temp_dir`); at the session's end, JAX's caches cleared while
the session still runs (`pytest_sessionfinish`).

The suite is written for the CPU: its tensor-parallel tests need the 8 fake devices and its tolerances the CPU's
float32 numerics. So a plain run keeps JAX on the CPU (JAX_PLATFORMS=cpu, also for the servers the tests start in
subprocesses) on a machine with a GPU too. The GPU tests (marked `gpu`) are selected with `-m gpu`, which leaves JAX
its default platform; run in several pytest-xdist workers, each worker takes its share of the GPU's memory
(`gpu_worker_memory`). A JAX_PLATFORMS the caller set (not empty) is kept as it is.

Every program the tests compile, in the pytest processes and in the servers and engine processes they start, goes
through one persistent compilation cache (`use_the_tests_compilation_cache`): many tests build engines of the same
tiny models and buckets, and a program compiled once is read back by the next test that lowers it (the engine's
compile counter counts lowerings, so its checks see cache hits too). It lies beside the product's own cache, not in
it, and a directory the caller names in JAX_COMPILATION_CACHE_DIR wins.
"""

import gc
import os
import sys
import tempfile

import pytest

from tests.support.jax_platform import gpu_worker_memory, selects_gpu_tests

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def use_the_tests_compilation_cache() -> None:
    """JAX's persistent compilation cache for every program of the session, at any compile time or size: set in the
    environment (read by the processes the tests start) and in this process's JAX config."""
    cache_root = os.environ.get("SGL_JAX_LORA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sgl_jax_lora")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(cache_root, "jax-compilation-cache-tests"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    import jax  # noqa: PLC0415 (after XLA_FLAGS; a plugin may have imported jax before the environment was set)

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes", int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])
    )


def pytest_configure(config):
    use_the_tests_compilation_cache()
    if selects_gpu_tests(config.getoption("markexpr") or ""):
        os.environ.update(gpu_worker_memory(os.environ))  # read when JAX starts its GPU client, after this hook
        return
    if os.environ.get("JAX_PLATFORMS"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # noqa: PLC0415 (after XLA_FLAGS; the config covers a jax a plugin imported before this hook)

    jax.config.update("jax_platforms", "cpu")


@pytest.fixture(scope="session", autouse=True)
def session_temp_dir(tmp_path_factory):
    """tempfile's directory, and TMPDIR for the processes the tests start, under pytest's base temp: the server logs,
    benchmark work directories and model directories that tests leave behind go with pytest's older base temps
    (it keeps the last three), not into /tmp for good."""
    path = str(tmp_path_factory.mktemp("tempfile"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", path)
        patch.setattr(tempfile, "tempdir", path)
        yield path


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish():
    """After the session's fixtures are torn down: clear JAX's caches of compiled programs and traces, and collect.
    A process that ran hundreds of tests holds thousands of them, and collecting them at its exit (pytest's
    unraisable-exception check collects 5 times, JAX's own exit hook clears them and collects 4 times) took over
    5 s on the 2-core CI machine. A pytest-xdist worker tells the controller it has finished only after this hook
    (the controller then interrupts a worker still alive 5 s after asking it to exit), so the work is done here."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    gc.collect()
