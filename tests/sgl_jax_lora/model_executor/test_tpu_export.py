"""The whole forward lowers for TPU: `jax.export(..., platforms=["tpu"])` on CPU, with the Mosaic attention kernel
and (LoRA on) the Pallas TPU SGMV kernels, at tp 1 and tp 4 over fake CPU devices, for decode, prefill and mixed
steps (one program per token bucket serves all three); with an 8-bit KV cache, with 8-bit weights, and with sliding
windows (Qwen2's: windowed and full layers in one rolled loop).

No TPU is reachable from CI. This proves that every kernel traces and that Pallas lowers it to Mosaic; libtpu's
compilation of the same programs (Mosaic's passes included) is test_tpu_compile.py's, and the speed on a TPU is not
checked anywhere.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from tests.support.model_export import STEPS, export_forward, forward_program, kernel_shaped_config, primitive_counts

pytestmark = [pytest.mark.tpu_export, pytest.mark.slow]


@pytest.mark.parametrize("tp_size", [1, 4])
@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("step", list(STEPS))
def test_forward_exports_for_tpu(model_config, tp_size, with_lora, step):
    exported = export_forward(model_config, tp_size, with_lora, *STEPS[step])
    module = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    # the attention kernel, once per scanned layer body, and the LoRA kernels when LoRA is on
    assert module.count("tpu_custom_call") >= (2 if with_lora else 1)
    assert "ragged_paged_attention" in module


@pytest.mark.parametrize("step", list(STEPS))
def test_forward_with_an_fp8_cache_exports_for_tpu(model_config, step):
    # --kv-cache-dtype fp8_e4m3 with --page-size 32 (an 8-bit page slab fills the 32-row sublane tile), tp 4
    exported = export_forward(model_config, 4, False, *STEPS[step], kv_dtype=jnp.float8_e4m3fn, page_size=32)
    module = exported.mlir_module()
    assert "ragged_paged_attention" in module and "f8E4M3FN" in module


@pytest.mark.parametrize("tp_size", [1, 4])
@pytest.mark.parametrize("step", list(STEPS))
def test_forward_with_sliding_windows_exports_for_tpu(tmp_path, tp_size, step):
    # layer 0 full, layer 1 windowed: each layer's window reaches the kernel as a scalar of the scanned loop
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True}
    cfg = kernel_shaped_config(tmp_path, max_window_layers=1, **qwen2)
    assert cfg.sliding_windows == (0, 64)
    exported = export_forward(cfg, tp_size, True, *STEPS[step])
    assert "ragged_paged_attention" in exported.mlir_module()


@pytest.mark.parametrize("tp_size", [1, 4])
def test_forward_with_fp8_weights_exports_for_tpu(model_config, tp_size):
    """--quantization fp8 off Hopper GPUs: every layer linear an 8-bit dot of 8-bit operands (the kernel's pure-JAX
    reference; under tp 4 inside shard_map where the shards fit its tiles, else XLA's dot), with LoRA on."""
    exported = export_forward(model_config, tp_size, True, *STEPS["decode"], quantization="fp8")
    module = exported.mlir_module()
    assert "ragged_paged_attention" in module
    eight_bit = re.findall(r"dot_general .*: \(tensor<[0-9x]+xf8E4M3FN>, tensor<[0-9x]+xf8E4M3FN>\)", module)
    assert len(eight_bit) == 4  # q|k|v, o, gate|up and down, once in the scanned layer body


@pytest.mark.parametrize("step", list(STEPS))
def test_attention_layout_is_built_once_before_the_layer_loop(model_config, step):
    """The q-block layout of the TPU kernel (which sequences each q block holds: two searchsorted) comes from the
    forward's plan, built before the layer loop, not again in each layer of a rolled loop."""
    forward, args = forward_program(model_config, 1, False, *STEPS[step])
    counts = primitive_counts(forward.trace(*args).jaxpr.jaxpr)
    assert ("pallas_call", True) in counts  # the attention kernel in the rolled layer loop of forward_program
    assert counts.get(("jit:searchsorted", False)) == 2  # first and last sequence of each q block, once per forward
    assert ("jit:searchsorted", True) not in counts
