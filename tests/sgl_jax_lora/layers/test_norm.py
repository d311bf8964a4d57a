"""sgl_jax_lora/layers/norm.py: RMSNorm matches HF transformers' LlamaRMSNorm in float32 and bit for bit in
bfloat16 (statistics in float32, the normalised values rounded to bfloat16 before the scale multiplies them);
it normalises over the last axis only, keeps the input dtype, stays finite on zeros, and declares its scale's
logical axis."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from sgl_jax_lora.layers.norm import RMSNorm


def hf_norm(x: np.ndarray, scale: np.ndarray, eps: float, dtype: torch.dtype) -> np.ndarray:
    norm = LlamaRMSNorm(scale.shape[0], eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(scale).to(dtype))
        out = norm(torch.tensor(x).to(dtype))
    return out.float().numpy()


def make_norm(scale: np.ndarray, eps: float, dtype) -> RMSNorm:
    norm = RMSNorm(scale.shape[0], eps, dtype, "embed")
    norm.scale[...] = jnp.asarray(scale, dtype)
    return norm


def test_float32_matches_hf():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * 4
    scale = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    out = make_norm(scale, 1e-6, jnp.float32)(jnp.asarray(x))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), hf_norm(x, scale, 1e-6, torch.float32), rtol=2e-6, atol=2e-6)


def test_bfloat16_matches_hf_bit_for_bit():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 128)) * 3).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # values exactly representable in bf16
    scale = np.asarray(jnp.asarray(rng.uniform(0.2, 2.0, 128), jnp.bfloat16).astype(jnp.float32))
    out = make_norm(scale, 1e-5, jnp.bfloat16)(jnp.asarray(x, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    expected = hf_norm(x, scale, 1e-5, torch.bfloat16)
    got = np.asarray(out.astype(jnp.float32))
    mismatched = np.mean(got != expected)
    assert mismatched < 0.005  # a last-bit difference of rsqrt may flip a rare rounding
    np.testing.assert_allclose(got, expected, rtol=2**-7)


def test_bfloat16_rounds_before_scaling_and_keeps_statistics_in_float32():
    rng = np.random.default_rng(2)
    x = np.asarray(jnp.asarray(rng.standard_normal((256, 512)) * 10 + 3, jnp.bfloat16).astype(jnp.float32))
    scale = np.asarray(jnp.asarray(rng.uniform(0.3, 3.0, 512), jnp.bfloat16).astype(jnp.float32))
    got = np.asarray(make_norm(scale, 1e-6, jnp.bfloat16)(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))

    def bf16(a: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))

    normed = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    two_roundings = bf16(bf16(normed) * scale)  # the recipe: round the normalised values, then scale
    one_rounding = bf16(normed * scale)  # scaling in float32 first would round once
    assert np.mean(got == two_roundings) > 0.99
    assert np.mean(got == one_rounding) < np.mean(got == two_roundings) - 0.05


def test_each_row_is_normalised_over_the_last_axis_alone():
    x = np.array([[3.0, 4.0], [30.0, 40.0], [0.0, 2.0]], np.float32)
    out = np.asarray(make_norm(np.ones(2, np.float32), 0.0, jnp.float32)(jnp.asarray(x)))
    rms = np.sqrt(np.array([12.5, 1250.0, 2.0]))[:, None]
    np.testing.assert_allclose(out, x / rms, rtol=1e-6)
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6)  # scaling a row does not change its output


def test_eps_keeps_a_zero_row_finite_and_damps_small_ones():
    norm = make_norm(np.ones(4, np.float32), 1e-2, jnp.float32)
    out = np.asarray(norm(jnp.zeros((1, 4), jnp.float32)))
    assert np.all(out == 0.0)
    small = np.full((1, 4), 0.1, np.float32)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(small))), 0.1 / np.sqrt(0.01 + 1e-2), rtol=1e-6)


def test_scale_starts_at_one_and_declares_its_axis():
    norm = RMSNorm(8, 1e-6, jnp.bfloat16, "head_dim")
    assert norm.scale[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(norm.scale[...], np.float32), np.ones(8))
    assert norm.scale.get_metadata()["logical_axes"] == ("head_dim",)
    assert norm.eps == 1e-6
