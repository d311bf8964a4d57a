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
    delta = jnp.einsum(
        "tr,tor->to", scaled, lora_b[token_slot].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) + delta


def gemm_lora_entries_ref(
    x: jax.Array,  # [T, in]
    w_rows: jax.Array,  # [L * in, out]
    w_row: jax.Array,  # [1] i32
    tile_part: jax.Array,  # [out / cta_n] i32
    tile_part_col: jax.Array,  # [out / cta_n] i32
    entry_start: jax.Array,  # [T / tile_m + 1] i32
    entry_slot: jax.Array,  # [E] i32
    s_entries: jax.Array,  # [P * E, tile_m, R]
    b_rows: tuple[jax.Array, ...],  # P x [slots, out_p, R]
    *,
    tile_m: int,
) -> jax.Array:
    """[T, out] in x's dtype: what `gemm_lora_gpu_entries` computes from the same operands, in float32 (the
    kernel's accumulator) and from the entry layout itself, so entry bounds and empty tiles act as in the
    kernel. Parts lie side by side in the order of b_rows (tile_part and tile_part_col are implied by them)."""
    num_tokens, in_dim = x.shape
    num_entries = entry_slot.shape[0]
    w = jax.lax.dynamic_slice_in_dim(w_rows, w_row[0], in_dim, axis=0)
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    entry = jnp.arange(num_entries)
    entry_tile = jnp.searchsorted(entry_start, entry, side="right") - 1  # the row tile whose range holds the entry
    is_used = entry < entry_start[-1]
    deltas = []
    for part, b in enumerate(b_rows):
        s_part = s_entries[part * num_entries : (part + 1) * num_entries].astype(jnp.float32)
        rows = jnp.einsum(
            "etr,eor->eto", s_part, b[entry_slot].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        rows = jnp.where(is_used[:, None, None], rows, 0.0)
        per_tile = jax.ops.segment_sum(rows, jnp.clip(entry_tile, 0), num_segments=num_tokens // tile_m)
        deltas.append(per_tile.reshape(num_tokens, b.shape[1]))
    return (y + jnp.concatenate(deltas, axis=1)).astype(x.dtype)
