"""The whole forward lowers for CUDA with the GPU attention backend (`.lower(lowering_platforms=("cuda",))` on CPU),
at tp 1 and tp 2 over fake CPU devices: the Triton kernels trace and lower, and each layer rotates q and k and
writes K/V in the one kernel of pallas_kernels/attention/kv_write_gpu.py (by rotary tables computed once per forward),
with no rotary or K/V scatter left to XLA in the layers.
The GPU tests of the kernels (marked `gpu`) check what they compute."""

from __future__ import annotations

import pytest

from sgl_jax_lora.configs.model_config import ModelConfig
from tests.support.model_export import STEPS, kernel_shaped_config, lower_forward_for_cuda

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    return kernel_shaped_config(tmp_path_factory.mktemp("gpu-model"))


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("step", list(STEPS))
def test_forward_lowers_for_cuda_with_rotary_inside_the_kv_write(model_config, tp_size, step):
    text = lower_forward_for_cuda(model_config, tp_size, *STEPS[step])
    assert "rope_kv_write" in text and "ragged_paged_attention_decode" in text
    assert text.count("stablehlo.cosine") == 1  # the rotary tables: once per forward, not once per layer
    # the only scatter left is the attention's: decode rows into the general kernel's output
    assert text.count('"stablehlo.scatter"(') == 1
