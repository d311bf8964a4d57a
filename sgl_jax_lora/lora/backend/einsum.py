"""One-hot einsum LoRA backend: the formulation of sgl-jax and tpu-inference, kept as the baseline.

Every token is multiplied against every slot's weights through a one-hot [T, A] matrix, so the cost grows
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
        one_hot = jax.nn.one_hot(lora.token_slot, lora_a.shape[0], dtype=x.dtype)  # [T, A]
        s = jnp.einsum(
            "ti,ta,ari->tr", x, one_hot, lora_a,
            precision=dot_precision(x.dtype, lora_a.dtype), preferred_element_type=jnp.float32,
        )
        return self.constrain(s, shrink_out_spec())

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        s = s.astype(lora_b.dtype)
        one_hot = jax.nn.one_hot(lora.token_slot, lora_b.shape[0], dtype=lora_b.dtype)  # [T, A]
        y = jnp.einsum(
            "tr,ta,aor->to", s, one_hot, lora_b,
            precision=dot_precision(lora_b.dtype), preferred_element_type=jnp.float32,
        )
        return self.constrain(y.astype(out_dtype), expand_out_spec(output_sharded))
