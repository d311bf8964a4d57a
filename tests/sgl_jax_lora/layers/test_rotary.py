"""sgl_jax_lora/layers/rotary.py: the inverse frequencies of the default, linear and llama3 rope rules, YaRN's against
HF transformers' own computation, the tables scaled by YaRN's attention factor, and apply_rotary against a numpy
rotation of each (first half, second half) pair."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.configs.model_config import ModelConfig, RopeConfig
from sgl_jax_lora.layers.rotary import apply_rotary, inverse_frequencies, rotary_tables

HEAD_DIM = 16


def test_default_and_linear_frequencies():
    default = inverse_frequencies(RopeConfig(theta=10000.0, rope_type="default"), HEAD_DIM)
    expected = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    assert default.dtype == np.float32 and default.shape == (HEAD_DIM // 2,)
    np.testing.assert_allclose(default, expected, rtol=1e-6)
    linear = inverse_frequencies(RopeConfig(theta=10000.0, rope_type="linear", factor=4.0), HEAD_DIM)
    np.testing.assert_allclose(linear, expected / 4.0, rtol=1e-6)


def test_llama3_keeps_high_frequencies_scales_low_ones_and_blends_between():
    rope = RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position=64,
    )
    base = inverse_frequencies(RopeConfig(theta=500000.0, rope_type="default"), HEAD_DIM)
    scaled = inverse_frequencies(rope, HEAD_DIM)
    wavelen = 2 * math.pi / base.astype(np.float64)
    high, low = wavelen < 64 / 4.0, wavelen > 64 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()  # this head_dim reaches all three regimes
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8.0)


def test_apply_rotary_rotates_each_half_pair_by_position_times_frequency():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, HEAD_DIM)).astype(np.float32)
    positions = np.array([0, 1, 2, 7, 100], np.int32)
    inv_freq = inverse_frequencies(RopeConfig(theta=10000.0, rope_type="default"), HEAD_DIM)
    out = np.asarray(apply_rotary(jnp.asarray(x), jnp.asarray(positions), inv_freq))
    angles = positions[:, None, None] * inv_freq[None, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    expected = np.concatenate(
        [x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1
    )
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_array_equal(out[0], x[0])  # position 0: unchanged
    bf16 = apply_rotary(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions), inv_freq)
    assert bf16.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0, "original_max_position_embeddings": 128},  # Qwen2.5's form
        {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    ],
)
def test_yarn_frequencies_and_attention_factor_match_transformers(scaling):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    rope_scaling = {"rope_type": "yarn", **scaling}
    hf = Qwen2Config(**raw, rope_theta=10000.0, rope_scaling=rope_scaling)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rope = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            **raw,
            "rope_theta": 10000.0,
            "rope_scaling": rope_scaling,
            "num_hidden_layers": 1,
            "intermediate_size": 64,
            "vocab_size": 32,
        }
    ).rope
    got = inverse_frequencies(rope, 64)
    default = inverse_frequencies(RopeConfig(theta=10000.0, rope_type="default"), 64)
    np.testing.assert_allclose(got, want_freq.numpy(), rtol=1e-6)
    assert (got == default).any() and (got < default).any()  # kept and interpolated frequencies both present
    assert rope.attention_factor == pytest.approx(want_factor)
    cos, sin = rotary_tables(jnp.arange(5, dtype=jnp.int32), got, rope.attention_factor)
    np.testing.assert_allclose(np.asarray(cos[0]), rope.attention_factor, rtol=1e-6)  # position 0: cos 1, scaled
    np.testing.assert_allclose(np.asarray(cos**2 + sin**2), rope.attention_factor**2, rtol=1e-5)
