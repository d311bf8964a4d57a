"""Pure-JAX reference for the SGMV kernels: what `sgmv_shrink_*` and `sgmv_expand_*` must compute.

It takes the same segment metadata as the kernels, recovers each token's slot from the segments (so the
segment handling itself is checked), and computes every product densely in float32. Columns of B (and,
given `rank_block`, rows of A) at or above a slot's true rank are ignored, as the kernels may skip them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_slot_from_segments(
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
) -> jax.Array:
    """[T] i32 slot of each token (original order) as the segments describe it; uncovered rows get 0."""
    num_tokens = sort_perm.shape[0]
    sorted_pos = jnp.arange(num_tokens, dtype=jnp.int32)
    seg = jnp.searchsorted(seg_start, sorted_pos, side="right") - 1
    is_covered = (seg >= 0) & (seg < seg_slot.shape[0]) & (sorted_pos < seg_start[-1])
    sorted_slot = jnp.where(is_covered, seg_slot[jnp.clip(seg, 0, seg_slot.shape[0] - 1)], 0)
    return jnp.zeros((num_tokens,), jnp.int32).at[sort_perm].set(sorted_slot)


def _rank_mask(token_slot: jax.Array, slot_rank: jax.Array, max_rank: int, rank_block: int | None) -> jax.Array:
    """[T, R] True where column r counts for the token: (r mod rank_block) < rank, or rank > 0 if None."""
    rank = slot_rank[token_slot][:, None]
    if rank_block is None:
        return jnp.broadcast_to(rank > 0, (token_slot.shape[0], max_rank))
    return jnp.arange(max_rank)[None, :] % rank_block < rank


def sgmv_shrink_ref(
    x: jax.Array,  # [T, in]
    lora_a: jax.Array,  # [A, R, in]
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    rank_block: int | None = None,
) -> jax.Array:
    """[T, R] float32: x_t @ A[slot_t].T; columns at or above the slot's rank (within each block of
    `rank_block` rows of a packed A) zero; rank-0 slots give zero rows."""
    token_slot = token_slot_from_segments(sort_perm, seg_start, seg_slot)
    a_tok = lora_a[token_slot].astype(jnp.float32)  # [T, R, in]
    out = jnp.einsum("ti,tri->tr", x.astype(jnp.float32), a_tok, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(_rank_mask(token_slot, slot_rank, lora_a.shape[1], rank_block), out, 0.0)


def sgmv_expand_ref(
    s: jax.Array,  # [T, R] f32
    lora_b: jax.Array,  # [A, out, R]
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    out_dtype: jnp.dtype,
) -> jax.Array:
    """[T, out] out_dtype: s_t @ B[slot_t].T using only the slot's first rank columns."""
    token_slot = token_slot_from_segments(sort_perm, seg_start, seg_slot)
    s = jnp.where(_rank_mask(token_slot, slot_rank, lora_b.shape[2], lora_b.shape[2]), s.astype(jnp.float32), 0.0)
    b_tok = lora_b[token_slot].astype(jnp.float32)  # [T, out, R]
    out = jnp.einsum("tr,tor->to", s, b_tok, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def gemm_lora_ref(
    x: jax.Array,  # [T, in]
    w: jax.Array,  # [in, out]
    s: jax.Array,  # [T, R] f32 shrink output
    token_slot: jax.Array,  # [T] i32
    slot_scale: jax.Array,  # [A] f32
    lora_b: jax.Array,  # [A, out, R]
) -> jax.Array:
    """[T, out] float32: what `gemm_lora_gpu` computes, x @ W + (scale * s, rounded to bf16 as the kernel
    takes it) @ B[slot].T, in float32."""
    scaled = (s * slot_scale[token_slot][:, None]).astype(jnp.bfloat16).astype(jnp.float32)
    delta = jnp.einsum("tr,tor->to", scaled, lora_b[token_slot].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) + delta
