"""The whole forward lowers for CUDA with the GPU attention backend (`.lower(lowering_platforms=("cuda",))` on CPU),
at tp 1 and tp 2 over fake CPU devices: the Triton kernels trace and lower, and each layer rotates q and k and
writes K/V in the one kernel of pallas_kernels/attention/kv_write_gpu.py (by rotary tables computed once per forward),
with no rotary or K/V scatter left to XLA in the layers; the attention's row layout (the decode rows' longest-first
sort, the q block table) is built once per forward, before the layer loop, not again in each layer; a model of 7 query
heads per kv head (Qwen2.5-7B's) lowers too.
The GPU tests of the kernels (marked `gpu`) check what they compute."""

from __future__ import annotations

import pytest

from tests.support.model_export import (
    STEPS,
    forward_program,
    kernel_shaped_config,
    lower_forward_for_cuda,
    primitive_counts,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("step", list(STEPS))
def test_forward_lowers_for_cuda_with_rotary_inside_the_kv_write(model_config, tp_size, step):
    text = lower_forward_for_cuda(model_config, tp_size, *STEPS[step])
    assert "rope_kv_write" in text and "ragged_paged_attention_decode" in text
    assert text.count("stablehlo.cosine") == 1  # the rotary tables: once per forward, not once per layer
    # the only scatter left is the attention's: decode rows into the general kernel's output
    assert text.count('"stablehlo.scatter"(') == 1


@pytest.mark.parametrize("step", list(STEPS))
def test_attention_layout_is_built_once_before_the_layer_loop(model_config, step):
    forward, args = forward_program(model_config, 1, False, *STEPS[step], attention_backend="pallas_gpu")
    counts = primitive_counts(forward.trace(*args).jaxpr.jaxpr)
    assert counts.get(("scan", False)) == 1  # the rolled layer loop of forward_program
    assert counts.get(("sort", False)) == 1  # the decode rows' longest-first order, once per forward
    assert ("sort", True) not in counts and ("cumsum", True) not in counts  # nor the q block table in the loop


def test_forward_lowers_for_cuda_at_a_group_of_seven(tmp_path):
    # Qwen2.5-7B's attention (7 query heads per kv head, q/k/v biases): the rotary + K/V write kernel and both
    # attention kernels take it
    cfg = kernel_shaped_config(
        tmp_path, architectures=["Qwen2ForCausalLM"], num_attention_heads=14, num_key_value_heads=2
    )
    assert cfg.num_heads // cfg.num_kv_heads == 7 and cfg.qkv_bias
    text = lower_forward_for_cuda(cfg, 1, *STEPS["prefill_or_mixed"])
    assert "rope_kv_write" in text and "ragged_paged_attention_decode" in text
    assert "ragged_paged_attention_prefill" in text
