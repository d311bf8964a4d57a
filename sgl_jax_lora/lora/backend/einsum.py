"""One-hot einsum LoRA backend: the formulation of sgl-jax and tpu-inference, kept as the baseline.

Every token is multiplied against every slot's weights (x @ all A, then each token's own slot selected), so the
cost grows with the number of slots A, not with the adapters actually in the batch. No rank awareness: every slot
is computed at the pool's max rank R (padding rows are zeros, so results are exact, only the work is wasted).
Tenants stay apart: the shrink selects (jnp.where) instead of multiplying by a one-hot, and the expand zeroes
non-finite weights, so an adapter holding NaN or Inf changes no other slot's tokens. Pure JAX; under jit,
sharding follows from GSPMD propagation (the `in` contraction of a row-parallel shrink becomes an all-reduce
of the [T, R] result).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax_lora.lora.backend.base import dot_precision
from sgl_jax_lora.lora.backend.xla import XlaBackend, expand_out_spec, shrink_out_spec
from sgl_jax_lora.lora.lora_batch import LoRABatch


class EinsumBackend(XlaBackend):
    name = "einsum"

    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        # contraction order pinned: x against every slot's A (one dense GEMM reading each A once), then each
        # token keeps its own slot's row. Left to opt_einsum, a one-hot einsum of equal FLOPs would materialize a
        # [T, R, in] per-token weight copy.
        s_all = jnp.einsum(
            "ti,ari->tar",
            x,
            lora_a,
            precision=dot_precision(x.dtype, lora_a.dtype),
            preferred_element_type=jnp.float32,
        )
        # select, never multiply by a one-hot: 0 x NaN is NaN, so one slot holding a NaN would reach every token
        s = jnp.where(own_slot(lora, lora_a.shape[0])[:, :, None], s_all, 0.0).sum(axis=1)
        return self.constrain(s, shrink_out_spec())

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        # [T, A, R] with each token's s in its own slot's block (exact zeros elsewhere), then one dense GEMM
        # against every slot's B; a non-finite weight is zeroed so that 0 x it stays 0 for the other slots' tokens
        mine = own_slot(lora, lora_b.shape[0])
        s_slots = jnp.where(mine[:, :, None], s.astype(lora_b.dtype)[:, None, :], 0)
        y = jnp.einsum(
            "tar,aor->to",
            s_slots,
            finite_or_zero(lora_b),
            precision=dot_precision(lora_b.dtype),
            preferred_element_type=jnp.float32,
        )
        return self.constrain(y.astype(out_dtype), expand_out_spec(output_sharded))


def own_slot(lora: LoRABatch, num_slots: int) -> jax.Array:
    """[T, A] bool: token t uses slot a."""
    return lora.token_slot[:, None] == jnp.arange(num_slots, dtype=lora.token_slot.dtype)[None, :]


def finite_or_zero(weights: jax.Array) -> jax.Array:
    """`weights` with NaN and Inf replaced by 0 (backends that multiply every token by every slot's weights)."""
    return jnp.where(jnp.isfinite(weights), weights, jnp.zeros((), weights.dtype))
