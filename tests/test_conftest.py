"""The test setup of tests/conftest.py: which `-m` expressions leave JAX its default platform, and the GPU memory each
pytest-xdist worker of a GPU run may take."""

import os

import jax
import pytest

from tests.support.jax_platform import GPU_MEMORY_FOR_WORKERS, gpu_worker_memory, selects_gpu_tests


@pytest.mark.parametrize(
    ("markexpr", "selects"),
    [("gpu", True), ("gpu and not slow", True), ("", False), ("not slow", False), ("not gpu", False)],
)
def test_only_expressions_asking_for_gpu_tests_keep_the_default_platform(markexpr, selects):
    assert selects_gpu_tests(markexpr) is selects


def test_a_plain_run_computes_on_the_cpu(request):
    if selects_gpu_tests(request.config.getoption("markexpr") or ""):
        pytest.skip("a -m gpu run leaves JAX its default platform")
    assert os.environ["JAX_PLATFORMS"]  # set here, or by the caller (then kept as it is)
    if os.environ["JAX_PLATFORMS"] == "cpu":
        assert jax.default_backend() == "cpu"
        assert len(jax.devices()) == 8  # the fake devices of the tensor-parallel tests


def test_gpu_workers_share_the_gpus_memory_and_keep_the_callers_settings():
    assert gpu_worker_memory({}) == {} and gpu_worker_memory({"PYTEST_XDIST_WORKER_COUNT": "1"}) == {}
    four = gpu_worker_memory({"PYTEST_XDIST_WORKER_COUNT": "4"})
    assert four == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.225"}
    six = float(gpu_worker_memory({"PYTEST_XDIST_WORKER_COUNT": "6"})["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    assert 6 * six <= GPU_MEMORY_FOR_WORKERS
    mine = {"PYTEST_XDIST_WORKER_COUNT": "4", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert gpu_worker_memory(mine) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
