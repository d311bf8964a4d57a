"""The test setup of tests/conftest.py: which `-m` expressions leave JAX its default platform."""

import os

import jax
import pytest

from tests.support.jax_platform import selects_gpu_tests


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
