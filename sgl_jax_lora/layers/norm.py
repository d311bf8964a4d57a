"""RMSNorm as Llama/Qwen define it (computed in float32, scaled after casting back).

Where it sits: the decoder layers of models/llama.py normalise the residual stream (and, in Qwen3, each head's
q and k) with it; `axis` is the logical axis of its scale, which layers/sharding.py maps to a mesh axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, axis: str):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x.dtype."""
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return normed * self.scale[...].astype(x.dtype)
