"""Rotary position embedding (HF "rotate half" layout) with default, linear, llama3 and yarn frequency rules (and
dynamic NTK, whose frequencies are the default ones within the context it is served at: ModelConfig.context_length).

`inverse_frequencies` (per model), `rotary_tables` (the cosines and sines of one forward's positions, computed once
and shared by the layers, scaled by YaRN's attention factor where the model has one), `rotate` (x by those tables),
`apply_rotary` (both in one call)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax_lora.configs.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with the rope type's scaling applied (none for dynamic NTK, which scales
    only past max_position_embeddings, where it is not served)."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        mid = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = np.where(is_mid, mid, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_frequencies(rope, inv_freq, head_dim)
    return inv_freq.astype(np.float32)


def _yarn_frequencies(rope: RopeConfig, inv_freq: np.ndarray, head_dim: int) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as HF transformers computes it: the frequencies that turn fewer than beta_slow times
    over the pretrained context are interpolated (divided by the factor), those that turn more than beta_fast times
    are kept, and a linear ramp over the dimensions between blends the two."""

    def dimension_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        turns = rope.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp  # 1: the pretrained frequency, 0: interpolated
    return inv_freq / rope.factor * (1.0 - kept) + inv_freq * kept


def rotary_tables(
    positions: jax.Array, inv_freq: tuple[float, ...] | np.ndarray, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> (cos, sin) [T, D/2] float32 of the angles position x inverse frequency, times `scale`
    (YaRN's attention factor, `RopeConfig.attention_factor`: q and k both rotate by the scaled tables, so scores
    grow by its square): computed once per forward and shared by every layer (the model passes them down)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D] rotated by the tables of `rotary_tables` (math in float32, the result in x's dtype)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: tuple[float, ...] | np.ndarray) -> jax.Array:
    """x [T, heads, D], positions [T] -> [T, heads, D] rotated (math in float32)."""
    return rotate(x, *rotary_tables(positions, inv_freq))
