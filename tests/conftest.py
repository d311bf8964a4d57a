"""Test setup, before any test imports jax: 8 fake CPU devices for the sharding tests, and the platform JAX runs on;
temporary files under pytest's base temp (`session_temp_dir`); at the session's end, JAX's caches cleared while
the session still runs (`pytest_sessionfinish`).

The suite is written for the CPU: its tensor-parallel tests need the 8 fake devices and its tolerances the CPU's
float32 numerics. So a plain run keeps JAX on the CPU (JAX_PLATFORMS=cpu, also for the servers the tests start in
subprocesses) on a machine with a GPU too. The GPU tests (marked `gpu`) are selected with `-m gpu`, which leaves JAX
its default platform; run in several pytest-xdist workers, each worker takes its share of the GPU's memory
(`gpu_worker_memory`). A JAX_PLATFORMS the caller set (not empty) is kept as it is.
"""

import gc
import os
import sys
import tempfile

import pytest

from tests.support.jax_platform import gpu_worker_memory, selects_gpu_tests

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def pytest_configure(config):
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
