"""SGMV shrink/expand kernels for CUDA GPUs (Pallas on Triton).

Where it sits: `sgl_jax_lora.lora.backend.pallas` calls these on GPU (and in interpret mode in tests).

Same work items as the TPU kernel (`work_list.make_work_list`: one per (row tile, segment) pair), but
Triton has no scalar prefetch, so each program reads its item from small int arrays and gathers its rows
through `sort_perm` itself: tokens are never permuted in HBM, and results are scattered straight back to
token order. Only the adapters present in the batch are read.

shrink: grid (work item, split of `in`). Splitting `in` keeps enough programs in flight when the batch has
few items (decode); each split writes its own float32 partial [splits, T, R] (no atomics, so results are
bit-reproducible), and the partials are summed by the caller or by the expand kernel when it loads s.
expand: grid (work item, block of `out`), over every part of a packed module in one launch (q|k|v: three
B buffers, each written into its own columns of the packed output); it sums the shrink partials, applies
the per-slot scale, and can add the delta into the base layer output in place (`base_out`, aliased to the
result), so the LoRA delta never makes its own round trip through HBM. Rows of base tokens are then not
touched at all.

Layer-stacked buffers: the model keeps each LoRA buffer as one [L, A, ...] array. Given `layer` (an int32
scalar), the kernels take that whole stack and offset into layer `layer` themselves, so no per-layer copy of
the slot pool is made (a Pallas call gets its operands as whole buffers: slicing the stack outside the
kernel would copy the layer's pool before every call).

Rank awareness: in shrink, a slot's A rows at or above its true rank are masked out of the loads when the
caller says how A's rows are blocked (`rank_block`: R for one module, the per-part R when q|k|v are stacked
along R). In expand, s columns at or above the rank are zeroed and B columns are skipped in units of
`rank_granule` (8: 16 bytes of bf16; a finer, per-column mask would stop Triton from vectorizing the row
loads), relying on the pool's zeros between the rank and the granule boundary. Base segments (rank 0) read
no weights. The matmul itself runs at the rank rounded up to a power of two >= 16 (Triton's static block),
which costs nothing measurable in the memory-bound decode regime; rows/columns past R are masked, so the
buffers are used as they are, never padded or copied.

Any projection size: where no block divides `in` (shrink) or a part's width (expand), the last block runs
past it and its columns there are masked out of the loads of x, A and B and the stores of the output, so
odd sizes (a tiny model's 40 or 88) need no padded copy. Sizes the blocks divide trace no such masks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sgmv.work_list import WorkList, gpu_block_rows, layer_operand, make_work_list, padded_perm

_MIN_DOT = 16
_TARGET_PROGRAMS = 264  # two waves on a 132-SM H100
_MAX_A_TILE = 64 * 128  # elements of the shrink's [rank, `in` block] A tile: 16 KB of bf16 per pipeline stage
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class GpuTiles:
    block_rows: int  # tm: sorted rows per work item
    block_in: int  # tk: `in` columns per shrink loop step
    block_out: int  # tn: `out` columns per expand program (divides every part's width)
    in_splits: int  # programs sharing one item's `in` range in shrink
    out_steps: int  # `out` blocks one expand program loops over (reuses its loaded s rows)
    num_warps: int = 4
    num_stages: int = 3  # the shrink's software pipeline over its `in` loop
    rank_granule: int = 8  # B columns above a slot's rank are skipped in units of this many; 0: never


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def padded_rank(max_rank: int) -> int:
    return max(_MIN_DOT, _next_pow2(max_rank))


def _as_parts(out_dims: int | tuple[int, ...] | None) -> tuple[int, ...] | None:
    if out_dims is None or isinstance(out_dims, tuple):
        return out_dims
    return (out_dims,)


def _in_block(in_dim: int, rank_pad: int) -> int:
    """The shrink's `in` block: the largest candidate dividing in_dim whose A tile [rank_pad, block] stays within
    _MAX_A_TILE, else one such power of two (16-256) whose last step is masked past in_dim."""
    widest = max(_MIN_DOT, min(256, _MAX_A_TILE // rank_pad))
    aligned = next((c for c in (256, 128, 64, 32, 16) if c <= widest and in_dim % c == 0), 0)
    return aligned or min(widest, max(_MIN_DOT, _next_pow2(in_dim)))


def _out_candidates(parts: tuple[int, ...], max_block_out: int) -> list[int]:
    """`out` blocks dividing every part; when none does, blocks up to the widest part's power of two, whose
    columns past a part's width are masked."""
    blocks = [c for c in (256, 128, 64, 32, 16) if c <= max_block_out]
    aligned = [c for c in blocks if all(p % c == 0 for p in parts)]
    return aligned or [c for c in blocks if c <= max(_MIN_DOT, _next_pow2(max(parts)))]


def _num_groups(parts: tuple[int, ...], group_cols: int) -> int:
    return sum(-(-p // group_cols) for p in parts)


def choose_tiles(
    num_tokens: int,
    num_segments: int,
    in_dim: int | None,
    out_dims: int | tuple[int, ...] | None,
    block_rows: int | None = None,
    shrink_rank: int = _MIN_DOT,
) -> GpuTiles:
    """Tile sizes from the static shapes: small row tiles for decode, more `in` splits when items are few.

    in_dim is only needed by shrink and out_dims (one width, or every part's width of a packed module) only
    by expand; pass None for the other. Any sizes: blocks that do not divide a dimension are masked past it.
    block_rows: the row tile (default `gpu_block_rows(num_tokens)`, the one the backend's work list is built for).
    shrink_rank: the rows R of the shrink's A buffer (q|k|v stacks its parts' ranks), which bound its `in` block:
    a wider A tile lowers the programs an SM holds (q|k|v at rank 16 ran its shrink faster with 128 than 256).
    """
    block_rows = block_rows or gpu_block_rows(num_tokens)
    num_items = -(-num_tokens // block_rows) + max(num_segments, 1) - 1
    block_in, in_splits = 0, 1
    if in_dim is not None:
        block_in = _in_block(in_dim, padded_rank(shrink_rank))
        k_steps = -(-in_dim // block_in)
        for split in range(1, k_steps + 1):
            if k_steps % split == 0:
                in_splits = split
                if num_items * split >= _TARGET_PROGRAMS:
                    break
    parts = _as_parts(out_dims)
    if parts is None:
        return GpuTiles(block_rows, block_in, 0, in_splits, 1)
    max_block_out = 128 if block_rows >= 64 else 256  # keeps the [tm, tn] f32 tile in registers
    candidates = _out_candidates(parts, max_block_out)
    enough = [c for c in candidates if num_items * _num_groups(parts, c) >= _TARGET_PROGRAMS]
    block_out = enough[0] if enough else min((c for c in candidates if c >= 64), default=candidates[-1])
    out_steps = 1
    while all(p % (block_out * out_steps * 2) == 0 for p in parts) and (
        num_items * _num_groups(parts, block_out) // (out_steps * 2) >= 2 * _TARGET_PROGRAMS
    ):
        out_steps *= 2
    return GpuTiles(block_rows, block_in, block_out, in_splits, out_steps)


def _dot_nt(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """lhs [M, K] @ rhs [N, K].T in float32; IEEE f32 (not tf32) when both are f32."""
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        lhs, rhs, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _at(rows: jax.Array, col_start: jax.Array | int, num_cols: int) -> tuple[jax.Array, jax.Array]:
    """Index arrays for a [len(rows), num_cols] gather: whole-array indexers lower to Triton pointer
    arithmetic and also run in interpret mode (which rejects mixing arrays with `pl.ds`)."""
    cols = col_start + jnp.arange(num_cols, dtype=jnp.int32)
    return rows[:, None], cols[None, :]


def _item_rows(perm_ref, tile, lo, hi, block_rows):
    """Original-order token index and in-segment mask of the item's rows."""
    pos = tile * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    rows = perm_ref[pl.ds(tile * block_rows, block_rows)]
    return rows, (pos >= lo) & (pos < hi)


def _shrink_kernel(
    tile_ref,
    slot_ref,
    lo_ref,
    hi_ref,
    rank_ref,
    perm_ref,
    layer_ref,
    x_ref,
    a_ref,
    o_ref,
    *,
    tiles,
    rank_pad,
    max_rank,
    rank_block,
    num_tokens,
    num_slots,
):
    # x_ref [T, in]; a_ref [L * A * R, in]; o_ref [splits * T, R] f32; rank_pad = R rounded up to a power of 2
    item, split = pl.program_id(0), pl.program_id(1)
    tm, tk = tiles.block_rows, tiles.block_in
    rank = rank_ref[item]
    rows, row_ok = _item_rows(perm_ref, tile_ref[item], lo_ref[item], hi_ref[item], tm)
    x_ok = jnp.broadcast_to((row_ok & (rank > 0))[:, None], (tm, tk))
    r_idx = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok = ((r_idx % rank_block) < rank) if rank_block else jnp.broadcast_to(rank > 0, (rank_pad,))
    if rank_pad > max_rank:
        r_ok = r_ok & (r_idx < max_rank)
    a_rows = (layer_ref[0] * num_slots + slot_ref[item]) * max_rank + r_idx
    a_ok = jnp.broadcast_to(r_ok[:, None], (rank_pad, tk))
    in_dim = x_ref.shape[1]
    k_steps = -(-in_dim // tk) // tiles.in_splits

    def step(j, acc):
        col_start = (split * k_steps + j) * tk
        x_mask, a_mask = x_ok, a_ok
        if in_dim % tk:  # the last block runs past `in`: its columns there are never read
            col_ok = (col_start + jnp.arange(tk, dtype=jnp.int32) < in_dim)[None, :]
            x_mask, a_mask = x_ok & col_ok, a_ok & col_ok
        x_blk = plgpu.load(x_ref.at[_at(rows, col_start, tk)], mask=x_mask, other=0)
        a_blk = plgpu.load(a_ref.at[_at(a_rows, col_start, tk)], mask=a_mask, other=0)
        return acc + _dot_nt(x_blk, a_blk)

    acc = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((tm, rank_pad), jnp.float32))
    out_ok = row_ok[:, None] & (r_idx < max_rank)[None, :]
    plgpu.store(o_ref.at[_at(split * num_tokens + rows, 0, rank_pad)], acc, mask=out_ok)


@dataclasses.dataclass(frozen=True)
class ExpandPart:
    """One part of a packed expand: its width, where its R columns of s and its output columns start, and
    its range of the launch's `out` program blocks."""

    out_dim: int
    s_col: int
    out_col: int
    first_group: int
    num_groups: int


def _expand_kernel(
    tile_ref,
    slot_ref,
    lo_ref,
    hi_ref,
    rank_ref,
    scale_ref,
    perm_ref,
    layer_ref,
    s_ref,
    *rest,
    tiles,
    parts,
    rank_pad,
    max_rank,
    num_tokens,
    num_splits,
    num_slots,
    has_base,
):
    # s_ref [splits * T, S] f32; rest = one b_ref [L * A * out_p, R] per part, optional base_ref [T, N], o_ref [T, N]
    b_refs = rest[: len(parts)]
    base_ref = rest[len(parts)] if has_base else None
    o_ref = rest[-1]
    item, group = pl.program_id(0), pl.program_id(1)
    tm, tn = tiles.block_rows, tiles.block_out
    rank = rank_ref[item]
    slot_index = layer_ref[0] * num_slots + slot_ref[item]
    rows, row_ok = _item_rows(perm_ref, tile_ref[item], lo_ref[item], hi_ref[item], tm)
    is_active = rank > 0
    r_idx = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok = r_idx < rank
    b_col_ok = (jax.lax.div(r_idx, tiles.rank_granule) * tiles.rank_granule < rank) if tiles.rank_granule else None
    if rank_pad > max_rank:
        r_ok = r_ok & (r_idx < max_rank)
        b_col_ok = (r_idx < max_rank) if b_col_ok is None else b_col_ok & (r_idx < max_rank)
    s_ok = (row_ok & is_active)[:, None] & r_ok[None, :]
    b_ok = (
        jnp.broadcast_to(is_active, (tn, rank_pad))
        if b_col_ok is None
        else jnp.broadcast_to(b_col_ok[None, :], (tn, rank_pad))
    )
    row_touch = jnp.broadcast_to((row_ok & is_active)[:, None], (tm, tn))
    row_write = jnp.broadcast_to(row_ok[:, None], (tm, tn))

    def run_part(part: ExpandPart, b_ref) -> None:
        s = jnp.zeros((tm, rank_pad), jnp.float32)
        for split in range(num_splits):
            s = s + plgpu.load(s_ref.at[_at(split * num_tokens + rows, part.s_col, rank_pad)], mask=s_ok, other=0)
        s = (s * scale_ref[slot_ref[item]]).astype(b_ref.dtype)
        first_block = (group - part.first_group) * tiles.out_steps
        is_ragged = part.out_dim % (tn * tiles.out_steps) != 0  # the part's last group runs past its width

        def step(j, carry):
            n_start = (first_block + j) * tn
            cols = n_start + jnp.arange(tn, dtype=jnp.int32)
            b_mask, touch, write = b_ok, row_touch, row_write
            if is_ragged:  # columns past the part's width: B rows not read, output columns not written
                col_ok = cols < part.out_dim
                b_mask, touch, write = b_ok & col_ok[:, None], touch & col_ok[None, :], write & col_ok[None, :]
            b_rows = slot_index * part.out_dim + cols
            b_blk = plgpu.load(b_ref.at[_at(b_rows, 0, rank_pad)], mask=b_mask, other=0)
            delta = _dot_nt(s, b_blk)  # [tm, tn]
            out_at = _at(rows, part.out_col + n_start, tn)
            if has_base:  # rows of base tokens are left as they are in the aliased base output
                base = plgpu.load(base_ref.at[out_at], mask=touch, other=0)
                plgpu.store(o_ref.at[out_at], (base.astype(jnp.float32) + delta).astype(o_ref.dtype), mask=touch)
            else:
                plgpu.store(o_ref.at[out_at], delta.astype(o_ref.dtype), mask=write)
            return carry

        jax.lax.fori_loop(0, tiles.out_steps, step, 0)

    if len(parts) == 1:
        run_part(parts[0], b_refs[0])
        return
    for part, b_ref in zip(parts, b_refs):
        is_mine = (group >= part.first_group) & (group < part.first_group + part.num_groups)
        pl.when(is_mine)(functools.partial(run_part, part, b_ref))


def _work_and_perm(
    work: WorkList | None,
    work_perm: jax.Array | None,
    sort_perm,
    seg_start,
    seg_slot,
    slot_rank,
    num_tokens,
    block_rows,
) -> tuple[WorkList, jax.Array]:
    """The precomputed work list and padded perm if given (built once per step for these row tiles, by the
    backend's `prepare` or on the host), else built here in jit."""
    if work is not None:
        return work, work_perm
    return make_work_list(seg_start, seg_slot, slot_rank, num_tokens, block_rows), padded_perm(
        sort_perm, block_rows, jnp
    )


def _work_args(work: WorkList) -> tuple[jax.Array, ...]:
    return (work.tile, work.slot, work.row_lo, work.row_hi, work.rank)


def fits_stacked_offsets(shape: tuple[int, ...]) -> bool:
    """Whether a kernel can index every element of a (stacked) buffer of this shape with int32 offsets."""
    return math.prod(shape) <= _INT32_MAX


@functools.partial(jax.jit, static_argnames=("tiles", "rank_block", "interpret"))
def sgmv_shrink_gpu_partials(
    x: jax.Array,  # [T, in]
    lora_a: jax.Array,  # [A, R, in], or [L, A, R, in] with `layer`
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    work: WorkList | None = None,
    work_perm: jax.Array | None = None,
    layer: jax.Array | None = None,  # i32 scalar: which layer of a stacked lora_a
    *,
    tiles: GpuTiles,
    rank_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """[in_splits, T, R] float32 partial sums of x_t @ A[slot_t].T (token order); sum over axis 0.

    rank_block: A's rows come in blocks of this size (R, or the per-part R of packed modules) and rows at or
    above the slot's rank within a block are skipped; None skips only rank-0 (base) slots.
    work, work_perm: the batch's work list for row tiles of `tiles.block_rows` (the backend's PallasGPUMeta.work), else built here.
    """
    num_tokens, in_dim = x.shape
    _, layer_arg = layer_operand(lora_a, layer)
    num_slots, max_rank, _ = lora_a.shape[-3:]
    if not fits_stacked_offsets(lora_a.shape):
        raise ValueError(f"LoRA A buffer {lora_a.shape} is too large for int32 offsets; pass one layer's slice")
    a_flat = lora_a.reshape(-1, in_dim)
    work, perm = _work_and_perm(
        work, work_perm, sort_perm, seg_start, seg_slot, slot_rank, num_tokens, tiles.block_rows
    )
    kernel = functools.partial(
        _shrink_kernel,
        tiles=tiles,
        rank_pad=padded_rank(max_rank),
        max_rank=max_rank,
        rank_block=rank_block,
        num_tokens=num_tokens,
        num_slots=num_slots,
    )
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tiles.in_splits * num_tokens, max_rank), jnp.float32),
        grid=(work.num_items, tiles.in_splits),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(*_work_args(work), perm, layer_arg, x, a_flat)
    return partials.reshape(tiles.in_splits, num_tokens, max_rank)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiles", "s_col", "out_col", "interpret"))
def sgmv_expand_gpu(
    s_partials: jax.Array,  # [splits, T, S] f32 or [T, S], S >= s_col + P * R
    lora_b: jax.Array | tuple[jax.Array, ...],  # [A, out_p, R] per part, or [L, A, out_p, R] with `layer`
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    slot_scale: jax.Array | None = None,  # [A] f32, multiplies s per slot; None = 1
    base_out: jax.Array | None = None,  # [T, N], N >= out_col + sum out_p; if given the result is base_out + delta
    work: WorkList | None = None,
    work_perm: jax.Array | None = None,
    layer: jax.Array | None = None,  # i32 scalar: which layer of stacked B buffers
    *,
    out_dtype: jnp.dtype,
    tiles: GpuTiles,
    s_col: int = 0,
    out_col: int = 0,
    interpret: bool = False,
) -> jax.Array:
    """(base_out +) scale[slot_t] * (sum of s partials)_t @ B[slot_t].T for every part, out_dtype, one launch.

    Part p reads columns s_col + p*R .. s_col + (p+1)*R of s and writes columns out_col + sum(out_<p) .. of
    the output: packed modules (q|k|v, gate|up) run one shrink on their stacked A and this one expand.
    Without base_out: [T, sum out_p]. With base_out: base_out's shape, each part's delta added into its
    columns in place (the other columns, and base tokens' rows, are not touched).
    work, work_perm: the batch's work list for row tiles of `tiles.block_rows` (the backend's PallasGPUMeta.work), else built here.
    """
    if s_partials.ndim == 2:
        s_partials = s_partials[None]
    lora_bs = lora_b if isinstance(lora_b, tuple) else (lora_b,)
    num_splits, num_tokens, s_cols = s_partials.shape
    _, layer_arg = layer_operand(lora_bs[0], layer)
    num_slots, _, max_rank = lora_bs[0].shape[-3:]
    if any(b.shape[-3] != num_slots or b.shape[-1] != max_rank or b.ndim != lora_bs[0].ndim for b in lora_bs):
        raise ValueError(f"packed parts must share slots and rank: {[b.shape for b in lora_bs]}")
    if not all(fits_stacked_offsets(b.shape) for b in lora_bs):
        raise ValueError(
            f"LoRA B buffers {[b.shape for b in lora_bs]} are too large for int32 offsets; pass one layer's slice"
        )
    widths = tuple(b.shape[-2] for b in lora_bs)
    has_base = base_out is not None
    if not has_base and out_col:
        raise ValueError("out_col needs base_out (the packed output the delta is added into)")
    if s_col + len(lora_bs) * max_rank > s_cols:
        raise ValueError(f"s has {s_cols} columns; part columns {s_col}..{s_col + len(lora_bs) * max_rank} do not fit")
    out_shape = base_out.shape if has_base else (num_tokens, sum(widths))
    if out_col + sum(widths) > out_shape[1]:
        raise ValueError(
            f"output has {out_shape[1]} columns; part columns {out_col}..{out_col + sum(widths)} do not fit"
        )
    group_cols = tiles.block_out * tiles.out_steps
    parts, first_group, col = [], 0, out_col
    for i, width in enumerate(widths):  # a part whose width group_cols does not divide masks its last group
        num_groups = -(-width // group_cols)
        parts.append(ExpandPart(width, s_col + i * max_rank, col, first_group, num_groups))
        first_group += num_groups
        col += width
    s_flat = s_partials.astype(jnp.float32).reshape(num_splits * num_tokens, s_cols)
    b_flats = [b.reshape(-1, max_rank) for b in lora_bs]
    work, perm = _work_and_perm(
        work, work_perm, sort_perm, seg_start, seg_slot, slot_rank, num_tokens, tiles.block_rows
    )
    scale = jnp.ones((num_slots,), jnp.float32) if slot_scale is None else slot_scale.astype(jnp.float32)
    kernel = functools.partial(
        _expand_kernel,
        tiles=tiles,
        parts=tuple(parts),
        rank_pad=padded_rank(max_rank),
        max_rank=max_rank,
        num_tokens=num_tokens,
        num_splits=num_splits,
        num_slots=num_slots,
        has_base=has_base,
    )
    operands = (*_work_args(work), scale, perm, layer_arg, s_flat, *b_flats)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(work.num_items, first_group),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=2),
        input_output_aliases={len(operands): 0} if has_base else {},
        interpret=interpret,
    )(*operands, *((base_out.astype(out_dtype),) if has_base else ()))
