"""The engine with --quantization fp8 (layers/fp8.py): 8-bit decoder linears, 16-bit adapters beside them.

A tiny Llama whose linears fit the fp8 kernel's tiles (on CPU its pure-JAX reference runs where the kernel would)
serves three prompts, two on PEFT adapters and one on the base model, prefilled in one bf16 step and then decoded.
Its prompt logprobs are compared with HF transformers + PEFT in float32: off by fp8's error, far less than what
leaving an adapter out moves them; the same at tp 2 (fake devices; q|k|v's shards no longer fit the tiles and take
XLA's dot, the others the reference under shard_map). The loader's 8-bit weights dequantize to the checkpoint's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sgl_jax_lora.layers.fp8 as fp8_module
from pallas_kernels.sgmv.gemm_gpu import is_hopper
from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.models import weight_loader
from sgl_jax_lora.models.weight_loader import load_model_state
from sgl_jax_lora.server_args import ServerArgs
from tests.sgl_jax_lora.lora.backend.test_pallas_gemm_lora import peft_logprobs
from tests.sgl_jax_lora.models.test_llama import hf_logits, log_softmax
from tests.support.kernel_sized_engine import (
    PROMPTS,
    count_calls,
    make_kernel_sized_model_and_adapters,
    serve_logprobs,
)
from tests.support.model_forward import model_logits

pytestmark = pytest.mark.slow  # engines end to end


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    return make_kernel_sized_model_and_adapters(tmp_path_factory.mktemp("fp8"))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_engine_serves_adapters_and_base_within_fp8_error_of_peft(model_and_adapters, tp_size):
    """Measured on CPU: mean |fp8 - PEFT| 0.21-0.25 per prompt token at tp 1 and 2 (the bf16 engine without fp8:
    0.02-0.03), where leaving the adapter out moves the logprobs by 0.77-0.84 on average."""
    base, adapters = model_and_adapters
    prompt, output = serve_logprobs(base, adapters, 3, quantization="fp8", tp_size=tp_size)
    for ids, adapter, ours, decoded in zip(PROMPTS, adapters + [None], prompt, output):
        expected = peft_logprobs(base, adapter, ids)
        error = float(np.abs(ours - expected).mean())
        assert error < 0.35, error
        assert len(decoded) == 3 and np.all(np.isfinite(decoded)) and np.all(decoded < 0)
        if adapter is not None:
            adapter_effect = float(np.abs(peft_logprobs(base, None, ids) - expected).mean())
            assert error < 0.5 * adapter_effect, (error, adapter_effect)


def test_fp8_weights_dequantize_to_the_checkpoints(model_and_adapters):
    """Every decoder linear is an 8-bit K-major [L, out, in] stack with a [L, 1] scale whose product is the 16-bit
    kernel transposed, within e4m3's rounding; every other parameter is the 16-bit model's own."""
    base, _ = model_and_adapters
    cfg = ModelConfig.from_model_path(str(base))

    def load(quantization):
        _, state = load_model_state(cfg, 1, 16, jnp.float32, make_mesh(1), None, quantization=quantization)
        return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}

    plain, fp8 = load(None), load("fp8")
    linears = [p for p in plain if p.startswith("layers.") and p.endswith("_proj.kernel")]
    assert sorted(linears) == sorted(p for p in fp8 if p.endswith("_proj.kernel")) and len(linears) == 4
    for path in linears:
        kernel, scale = fp8[path], fp8[path + "_scale"]
        assert kernel.dtype == jnp.float8_e4m3fn and kernel.shape == np.swapaxes(plain[path], 1, 2).shape
        assert scale.shape == (cfg.num_layers, 1)
        dequantized = np.asarray(kernel, np.float32) * np.asarray(scale)[:, :, None]
        expected = np.swapaxes(np.asarray(plain[path]), 1, 2)
        bound = 2.0**-4 * np.abs(expected) + np.asarray(scale)[:, :, None] * 2.0**-9
        assert np.all(np.abs(dequantized - expected) <= bound), path
    for path, value in plain.items():
        if path not in linears:
            np.testing.assert_array_equal(np.asarray(fp8[path]), np.asarray(value), err_msg=path)


def test_fp8_of_a_converted_checkpoint_is_refused(model_and_adapters, monkeypatch):
    base, _ = model_and_adapters
    monkeypatch.setattr(weight_loader, "is_converted_checkpoint", lambda path: True)
    cfg = ModelConfig.from_model_path(str(base))
    with pytest.raises(ModelConfigError, match="converted checkpoint.*serve the HF directory with --quantization fp8"):
        load_model_state(cfg, 1, 16, jnp.float32, make_mesh(1), None, quantization="fp8")


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="--quantization 'int4' is not supported; choose one of"):
        ServerArgs(quantization="int4")


@pytest.mark.gpu
@pytest.mark.skipif(not is_hopper(jax.devices()[0]), reason="needs a Hopper-class CUDA device (the fp8 kernel)")
def test_fp8_kernel_forward_matches_hf_within_fp8_error(model_and_adapters, monkeypatch):
    """One bf16 prefill forward of the kernel-sized model on a Hopper GPU, the fp8 kernel in every layer, against
    HF transformers in float32: fp8's error, as the same forward through the kernel's reference has on CPU (mean
    0.26 per logprob; bf16 without fp8 0.025)."""
    base, _ = model_and_adapters
    ids = np.array(PROMPTS[2])
    calls = count_calls(monkeypatch, fp8_module, "gemm_fp8_gpu")
    kernel = log_softmax(model_logits(base, ids, jnp.bfloat16, quantization="fp8", attention_backend="pallas_gpu"))
    hf = log_softmax(hf_logits(base, ids))
    error = float(np.abs(kernel - hf).mean())
    print(f"fp8 kernel forward: {len(calls)} kernel calls traced, mean |logprob - HF| {error:.4f}")
    assert len(calls) == 4  # q|k|v, o, gate|up, down: traced once in the layer scan
    assert error < 0.35
