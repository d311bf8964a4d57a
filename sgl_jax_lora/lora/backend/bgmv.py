"""BGMV LoRA backend: gather each token's adapter weights, then a batched matrix-vector product.

Pure JAX. Reads (and materializes) one [R, in] / [out, R] weight copy per token, so it suits decode with
few tokens and loses badly in prefill (T copies of the weights). No rank awareness: the gather copies all
R rows of every slot. Sharding follows from GSPMD propagation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax_lora.lora.backend.base import dot_precision
from sgl_jax_lora.lora.backend.xla import XlaBackend, expand_out_spec, shrink_out_spec
from sgl_jax_lora.lora.lora_batch import LoRABatch


class BgmvBackend(XlaBackend):
    name = "bgmv"

    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        a_tok = lora_a[lora.token_slot]  # [T, R, in]
        s = jnp.einsum(
            "ti,tri->tr",
            x,
            a_tok,
            precision=dot_precision(x.dtype, lora_a.dtype),
            preferred_element_type=jnp.float32,
        )
        return self.constrain(s, shrink_out_spec())

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        b_tok = lora_b[lora.token_slot]  # [T, out, R]
        y = jnp.einsum(
            "tr,tor->to",
            s.astype(lora_b.dtype),
            b_tok,
            precision=dot_precision(lora_b.dtype),
            preferred_element_type=jnp.float32,
        )
        return self.constrain(y.astype(out_dtype), expand_out_spec(output_sharded))
