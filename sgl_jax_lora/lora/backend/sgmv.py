"""SGMV LoRA backend in pure JAX: tokens grouped into segments by slot, only active adapters read.

Where it sits: `--lora-backend sgmv`; the Pallas backend is the kernel version of the same idea.

Two formulations of the segmented product, picked by platform:
- "ragged" (TPU, CPU): tokens permuted by `sort_perm` into segments and one `jax.lax.ragged_dot` over the
  G segment weights `A[seg_slot]`. Not used on GPU, where XLA's lowering of ragged_dot pads every group to
  the worst case (measured: up to 7.2x the base matmul).
- "segment_onehot" (GPU): no permutation; x against the G segments' weights (not the A slots), each token
  keeping its own segment's row (selected, not multiplied by a one-hot, so a NaN in one adapter reaches no
  other's tokens), so the work and the weight bytes scale with the adapters present in the batch.
No rank awareness in either: each segment is computed at the pool's max rank R (zero padding rows).
Sharding follows from GSPMD propagation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax_lora.lora.backend.base import dot_precision
from sgl_jax_lora.lora.backend.einsum import finite_or_zero
from sgl_jax_lora.lora.backend.xla import XlaBackend, expand_out_spec, shrink_out_spec
from sgl_jax_lora.lora.lora_batch import LoRABatch

METHODS = ("ragged", "segment_onehot")


def token_segment(lora: LoRABatch) -> jax.Array:
    """[T] i32 segment index of each token (original order)."""
    num_tokens = lora.token_slot.shape[0]
    sorted_pos = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all is one fused op; the default binary search becomes a device while loop (slow on GPU)
    seg_sorted = jnp.searchsorted(lora.seg_start[1:], sorted_pos, side="right", method="compare_all")
    seg_sorted = seg_sorted.astype(jnp.int32)
    seg_sorted = jnp.minimum(seg_sorted, lora.num_segments - 1)
    return jnp.zeros((num_tokens,), jnp.int32).at[lora.sort_perm].set(seg_sorted, unique_indices=True)


def _own_segment(lora: LoRABatch) -> jax.Array:
    """[T, G] bool: token t lies in segment g."""
    return token_segment(lora)[:, None] == jnp.arange(lora.num_segments, dtype=jnp.int32)[None, :]


def _group_sizes(lora: LoRABatch) -> jax.Array:
    return (lora.seg_start[1:] - lora.seg_start[:-1]).astype(jnp.int32)


def _unsort(values_sorted: jax.Array, lora: LoRABatch) -> jax.Array:
    return jnp.zeros_like(values_sorted).at[lora.sort_perm].set(values_sorted, unique_indices=True)


class SgmvBackend(XlaBackend):
    name = "sgmv"

    def __init__(self, mesh=None, method: str | None = None):
        super().__init__(mesh)
        if method is None:
            platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
            method = "segment_onehot" if platform in ("gpu", "cuda", "rocm") else "ragged"
        if method not in METHODS:
            raise ValueError(f"sgmv method {method!r}: choose one of {METHODS}")
        self.method = method

    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        a_seg = lora_a[lora.seg_slot]  # [G, R, in]: only the adapters present in the batch
        precision = dot_precision(x.dtype, lora_a.dtype)
        if self.method == "ragged":
            # XLA may lower ragged_dot densely with masks: non-finite weights are zeroed so they reach no other group
            s_sorted = jax.lax.ragged_dot(
                x[lora.sort_perm],
                jnp.swapaxes(finite_or_zero(a_seg), 1, 2),
                _group_sizes(lora),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            s = _unsort(s_sorted, lora)
        else:
            s_all = jnp.einsum("ti,gri->tgr", x, a_seg, precision=precision, preferred_element_type=jnp.float32)
            s = jnp.where(_own_segment(lora)[:, :, None], s_all, 0.0).sum(axis=1)  # select: 0 x NaN would be NaN
        return self.constrain(s, shrink_out_spec())

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        b_seg = lora_b[lora.seg_slot]  # [G, out, R]
        s = s.astype(lora_b.dtype)
        precision = dot_precision(lora_b.dtype)
        if self.method == "ragged":
            y_sorted = jax.lax.ragged_dot(
                s[lora.sort_perm],
                jnp.swapaxes(finite_or_zero(b_seg), 1, 2),
                _group_sizes(lora),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            y = _unsort(y_sorted, lora)
        else:
            s_segs = jnp.where(_own_segment(lora)[:, :, None], s[:, None, :], 0)  # [T, G, R]
            y = jnp.einsum(
                "tgr,gor->to", s_segs, finite_or_zero(b_seg), precision=precision, preferred_element_type=jnp.float32
            )
        return self.constrain(y.astype(out_dtype), expand_out_spec(output_sharded))
