"""One-hot einsum LoRA backend: the formulation of sgl-jax and tpu-inference, kept as the baseline.

Every token is multiplied against every slot's weights through a one-hot [T, A] matrix
(`einsum("ti,ta,ari->tr")`, evaluated as x @ all A then the one-hot pick), so the cost grows
with the number of slots A, not with the adapters actually in the batch. No rank awareness: every slot is
computed at the pool's max rank R (padding rows are zeros, so results are exact, only the work is wasted).
Pure JAX; under jit, sharding follows from GSPMD propagation (the `in` contraction of a row-parallel shrink
becomes an all-reduce of the [T, R] result).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax_lora.lora.backend.base import LoRABackend, dot_precision, expand_out_spec, shrink_out_spec
from sgl_jax_lora.lora.lora_batch import LoRABatch


class EinsumBackend(LoRABackend):
    name = "einsum"

    def shrink(
        self, x: jax.Array, lora_a: jax.Array, lora: LoRABatch, *, input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        one_hot = jax.nn.one_hot(lora.token_slot, lora_a.shape[0], dtype=jnp.float32)  # [T, A]
        # contraction order pinned: x against every slot's A (one dense GEMM reading each A once), then the
        # one-hot picks each token's slot. Left to opt_einsum, the equal-FLOP order one_hot x A would
        # materialize a [T, R, in] per-token weight copy.
        s_all = jnp.einsum(
            "ti,ari->tar", x, lora_a,
            precision=dot_precision(x.dtype, lora_a.dtype), preferred_element_type=jnp.float32,
        )
        s = jnp.einsum("tar,ta->tr", s_all, one_hot, precision=jax.lax.Precision.HIGHEST)
        return self.constrain(s, shrink_out_spec())

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        one_hot = jax.nn.one_hot(lora.token_slot, lora_b.shape[0], dtype=lora_b.dtype)  # [T, A]
        # [T, A, R] with each token's s in its own slot's block, then one dense GEMM against every slot's B
        s_slots = s.astype(lora_b.dtype)[:, None, :] * one_hot[:, :, None]
        y = jnp.einsum(
            "tar,aor->to", s_slots, lora_b,
            precision=dot_precision(lora_b.dtype), preferred_element_type=jnp.float32,
        )
        return self.constrain(y.astype(out_dtype), expand_out_spec(output_sharded))
