"""The MLP's activation and down's LoRA shrink in one pass, for CUDA GPUs (Pallas on Triton).

Where it sits: the Pallas GPU LoRA backend (lora/backend/pallas_gpu.py `apply_from_gated_product`) calls it where
gate|up hands over its packed product instead of its activation (the buckets where no GEMM kernel applies the
activation in its epilogue: gate|up on the GEMM with the LoRA inside it in the 1024 bucket, on XLA's dot in the 64
bucket). There the step would otherwise run XLA's activation over the [T, 2I] product, writing h = silu(gate) * up,
and then down's SGMV shrink, reading h back to compute s = h @ A_down[slot].T. This kernel does both from one read
of the product: each program computes its block of h, stores it (down's base GEMM reads it), and multiplies the
same block by its adapter's A rows.

The work and the grid are the SGMV shrink's (gpu.py: one program per (work item, split of `in`), each item a row
tile's rows of one segment, gathered through `sort_perm`, float32 partials [splits, T, R] summed by the expand).
Every row belongs to one item, and every column of h to one split, so each element of h is written once, base
tokens' rows included (their items read no A). Rows from `num_rows` on (the bucket's padding, whose product the GEMM
kernels may leave unwritten) are not read: their h is zero, as `zero_rows_from` makes it on the unfused path.

The activation rounds as the gated GEMM epilogue does: gate and up as they are (the product's dtype), silu(gate) *
up in float32, then h in the product's dtype; the shrink multiplies that rounded h, as the shrink kernel reads it.
`silu_mul_shrink_ref` (reference.py's shrink over the same h) is what it must compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sgmv.gpu import (
    GpuTiles,
    _at,
    _dot_nt,
    _item_rows,
    _work_and_perm,
    _work_args,
    fits_stacked_offsets,
    padded_rank,
)
from pallas_kernels.sgmv.reference import sgmv_shrink_ref
from pallas_kernels.sgmv.work_list import WorkList, layer_operand


def _kernel(
    tile_ref,
    slot_ref,
    lo_ref,
    hi_ref,
    rank_ref,
    perm_ref,
    layer_ref,
    rows_ref,
    y_ref,
    a_ref,
    s_ref,
    h_ref,
    *,
    tiles,
    rank_pad,
    max_rank,
    rank_block,
    num_tokens,
    num_slots,
):
    # y_ref [T, 2 * in] = [gate | up]; a_ref [L * A * R, in]; s_ref [splits * T, R] f32; h_ref [T, in]
    item, split = pl.program_id(0), pl.program_id(1)
    tm, tk = tiles.block_rows, tiles.block_in
    rank = rank_ref[item]
    rows, row_ok = _item_rows(perm_ref, tile_ref[item], lo_ref[item], hi_ref[item], tm)
    is_real = row_ok & (rows < rows_ref[0])
    y_ok = jnp.broadcast_to(is_real[:, None], (tm, tk))
    h_ok = jnp.broadcast_to(row_ok[:, None], (tm, tk))
    r_idx = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok = ((r_idx % rank_block) < rank) if rank_block else jnp.broadcast_to(rank > 0, (rank_pad,))
    if rank_pad > max_rank:
        r_ok = r_ok & (r_idx < max_rank)
    a_rows = (layer_ref[0] * num_slots + slot_ref[item]) * max_rank + r_idx
    a_ok = jnp.broadcast_to(r_ok[:, None], (rank_pad, tk))
    in_dim = h_ref.shape[1]
    k_steps = -(-in_dim // tk) // tiles.in_splits

    def step(j, acc):
        col_start = (split * k_steps + j) * tk
        y_mask, h_mask, a_mask = y_ok, h_ok, a_ok
        if in_dim % tk:  # the last block runs past `in`: its columns there are neither read nor written
            col_ok = (col_start + jnp.arange(tk, dtype=jnp.int32) < in_dim)[None, :]
            y_mask, h_mask, a_mask = y_ok & col_ok, h_ok & col_ok, a_ok & col_ok
        gate = plgpu.load(y_ref.at[_at(rows, col_start, tk)], mask=y_mask, other=0).astype(jnp.float32)
        up = plgpu.load(y_ref.at[_at(rows, in_dim + col_start, tk)], mask=y_mask, other=0).astype(jnp.float32)
        h = (gate * jax.nn.sigmoid(gate) * up).astype(h_ref.dtype)
        plgpu.store(h_ref.at[_at(rows, col_start, tk)], h, mask=h_mask)
        a_blk = plgpu.load(a_ref.at[_at(a_rows, col_start, tk)], mask=a_mask, other=0)
        return acc + _dot_nt(h, a_blk)

    acc = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((tm, rank_pad), jnp.float32))
    out_ok = row_ok[:, None] & (r_idx < max_rank)[None, :]
    plgpu.store(s_ref.at[_at(split * num_tokens + rows, 0, rank_pad)], acc, mask=out_ok)


@functools.partial(jax.jit, static_argnames=("tiles", "rank_block", "interpret"))
def silu_mul_shrink_gpu(
    y: jax.Array,  # [T, 2 * in]: the packed product [gate | up]
    lora_a: jax.Array,  # [A, R, in], or [L, A, R, in] with `layer`
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    num_rows: jax.Array,  # [1] i32: the step's real rows; h is zero from there on
    work: WorkList | None = None,
    work_perm: jax.Array | None = None,
    layer: jax.Array | None = None,  # i32 scalar: which layer of a stacked lora_a
    *,
    tiles: GpuTiles,
    rank_block: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(h [T, in] in y's dtype, silu(gate) * up with its rows from num_rows[0] on zero; [in_splits, T, R] float32
    partial sums of h_t @ A[slot_t].T). tiles: `choose_tiles` for `in` (the shrink's); rank_block and work as in
    `sgmv_shrink_gpu_partials`."""
    num_tokens, in_dim = y.shape[0], y.shape[1] // 2
    if y.shape[1] != 2 * in_dim or lora_a.shape[-1] != in_dim:
        raise ValueError(f"silu_mul_shrink_gpu: y {y.shape} must be [T, 2 * in] for A {lora_a.shape} of `in` columns")
    _, layer_arg = layer_operand(lora_a, layer)
    num_slots, max_rank, _ = lora_a.shape[-3:]
    if not fits_stacked_offsets(lora_a.shape):
        raise ValueError(f"LoRA A buffer {lora_a.shape} is too large for int32 offsets; pass one layer's slice")
    work, perm = _work_and_perm(
        work, work_perm, sort_perm, seg_start, seg_slot, slot_rank, num_tokens, tiles.block_rows
    )
    kernel = functools.partial(
        _kernel,
        tiles=tiles,
        rank_pad=padded_rank(max_rank),
        max_rank=max_rank,
        rank_block=rank_block,
        num_tokens=num_tokens,
        num_slots=num_slots,
    )
    partials, h = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((tiles.in_splits * num_tokens, max_rank), jnp.float32),
            jax.ShapeDtypeStruct((num_tokens, in_dim), y.dtype),
        ),
        grid=(work.num_items, tiles.in_splits),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(*_work_args(work), perm, layer_arg, num_rows.astype(jnp.int32), y, lora_a.reshape(-1, in_dim))
    return h, partials.reshape(tiles.in_splits, num_tokens, max_rank)


def silu_mul_shrink_ref(
    y: jax.Array,  # [T, 2 * in]
    lora_a: jax.Array,  # [A, R, in]
    sort_perm: jax.Array,
    seg_start: jax.Array,
    seg_slot: jax.Array,
    slot_rank: jax.Array,
    num_rows: jax.Array,  # [1] i32
    rank_block: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """What `silu_mul_shrink_gpu` computes, in pure JAX: (h, its shrink [T, R] float32, the partials summed)."""
    in_dim = y.shape[1] // 2
    gate, up = y[:, :in_dim].astype(jnp.float32), y[:, in_dim:].astype(jnp.float32)
    is_real = (jnp.arange(y.shape[0]) < num_rows[0])[:, None]
    h = jnp.where(is_real, gate * jax.nn.sigmoid(gate) * up, 0).astype(y.dtype)
    return h, sgmv_shrink_ref(h, lora_a, sort_perm, seg_start, seg_slot, slot_rank, rank_block)
