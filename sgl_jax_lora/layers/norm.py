"""RMSNorm as Llama/Qwen define it (computed in float32, scaled after casting back)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x.dtype."""
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return normed * self.scale[...].astype(x.dtype)
