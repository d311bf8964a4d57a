"""SGMV shrink/expand kernels for TPU (Pallas Mosaic): a grouped matmul over the segments of a LoRA batch.

Where it sits: `sgl_jax_lora.lora.backend.pallas` calls these on TPU (and in interpret mode in tests).

Tokens are permuted into slot order (`x[sort_perm]`) and cut into row tiles. The grid runs over work items
(row tile, segment), built by `work_list.make_work_list` and scalar-prefetched into SMEM, so the index maps
pick the adapter block `A[slot]` / `B[slot]` of each item: only adapters present in the batch are read, and
consecutive items of one segment keep the same weight block, which the pipeline does not fetch again. An
output tile stays resident in VMEM while consecutive items accumulate their masked rows into it.

Block shapes: rows a multiple of 16 (bf16 sublane packing), `in`/`out` blocks multiples of 128 (lanes);
the rank dimension is taken whole (a block dim equal to the array dim is always legal). Any projection
size: an `in` or `out` that is not a multiple of 128 is zero-padded to one at trace time (x's columns in
the same op that sorts its rows; the weights from one layer's slice, so a layer-stacked buffer is not
copied whole) and the result is sliced back; sizes already aligned trace no padding.

B's layout: the expand reads B as the TPU runtime holds it (`expand_weights_view`): out-minor ([.., R, out] in
memory) for a rank that is not a multiple of 128 lanes, row-major for ranks of whole lanes; so no step copies the
slot pool.

Layer-stacked buffers: given `layer` (an int32 scalar), A / B may be the model's whole [L, A, ...] stacks;
the layer index is scalar-prefetched with the work list and the weight index maps pick block
(layer, slot, ...), so no per-layer copy of the slot pool is made (a kernel's operands are whole buffers:
a slice taken outside the kernel would be a copy).

Rank awareness: items of base segments (rank 0) and empty tail items skip the matmul; results above a
slot's rank are masked (in shrink only when the caller gives `rank_block`, the row blocking of A, since a
packed q|k|v A stacks several rank blocks). The weight DMA of an item still moves all R rows: the block
shape is static, so padding rows above a slot's rank are read.

Speed on TPU is unmeasured (no TPU here); correctness is tested in interpret mode (`pltpu.InterpretParams`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.sgmv.work_list import WorkList, layer_operand, make_work_list

_LANES = 128
_ROW_ALIGN = 16


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _lane_block(dim: int, max_block: int) -> int:
    """Largest multiple of 128 that divides `dim` (itself a multiple of 128) and is <= max_block."""
    block = max(min(max_block, dim) // _LANES * _LANES, _LANES)
    while dim % block:
        block -= _LANES
    return block


def _lane_padded(
    weights: jax.Array, is_stacked: bool, layer_arg: jax.Array, axis: int, size: int
) -> tuple[jax.Array, bool, jax.Array]:
    """(weights, is_stacked, layer_arg) with `axis` (negative) zero-padded to `size` lanes. A layer-stacked
    buffer gives its layer's slice first, so only that layer is copied; aligned weights come back as they are."""
    if weights.shape[axis] == size:
        return weights, is_stacked, layer_arg
    if is_stacked:
        weights = jax.lax.dynamic_index_in_dim(weights, layer_arg[0], 0, keepdims=False)
    pad = [(0, 0)] * weights.ndim
    pad[axis] = (0, size - weights.shape[axis])
    return jnp.pad(weights, pad), False, jnp.zeros((1,), jnp.int32)


def _row_block(num_rows: int, max_block: int) -> int:
    return min(_round_up(max_block, _ROW_ALIGN), _round_up(max(num_rows, 1), _ROW_ALIGN))


def _interpret_arg(interpret: bool) -> pltpu.InterpretParams | bool:
    return pltpu.InterpretParams() if interpret else False


def _dot_nt(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """lhs [M, K] @ rhs[N, K].T in float32 (full f32 precision when both are f32)."""
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        lhs, rhs, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _row_mask(shape: tuple[int, int], tile: jax.Array, lo: jax.Array, hi: jax.Array, block_rows: int) -> jax.Array:
    row = tile * block_rows + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (row >= lo) & (row < hi)


def _rank_mask(shape: tuple[int, int], rank: jax.Array, rank_axis: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, shape, rank_axis) < rank


def _shrink_kernel(
    tile_ref, slot_ref, lo_ref, hi_ref, rank_ref, first_ref, layer_ref, x_ref, a_ref, o_ref, *, block_rows, rank_block
):
    # x_ref [tm, tk], a_ref [R, tk], o_ref [tm, R] f32 (resident across the items of one tile)
    del slot_ref, layer_ref
    item, k_step = pl.program_id(0), pl.program_id(1)

    @pl.when((first_ref[item] == 1) & (k_step == 0))
    def _zero():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(rank_ref[item] > 0)
    def _accumulate():
        partial = _dot_nt(x_ref[...], a_ref[...])  # [tm, R]
        keep = _row_mask(partial.shape, tile_ref[item], lo_ref[item], hi_ref[item], block_rows)
        if rank_block:
            col = jax.lax.broadcasted_iota(jnp.int32, partial.shape, 1)
            keep = keep & (col % rank_block < rank_ref[item])
        o_ref[...] += jnp.where(keep, partial, 0.0)


def _dot_nn(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """lhs [M, K] @ rhs[K, N] in float32 (full f32 precision when both are f32)."""
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        lhs, rhs, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _expand_kernel(
    tile_ref,
    slot_ref,
    lo_ref,
    hi_ref,
    rank_ref,
    first_ref,
    layer_ref,
    s_ref,
    b_ref,
    o_ref,
    acc_ref,
    *,
    block_rows,
    rank_major,
):
    # s_ref [tm, R] f32, b_ref [tn, R] ([R, tn] rank_major), o_ref [tm, tn], acc_ref [tm, tn] f32 scratch
    del slot_ref, layer_ref
    item = pl.program_id(1)

    @pl.when(first_ref[item] == 1)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(rank_ref[item] > 0)
    def _accumulate():
        b = b_ref[...]
        s = jnp.where(_rank_mask(s_ref.shape, rank_ref[item], 1), s_ref[...], 0.0)
        partial = (_dot_nn if rank_major else _dot_nt)(s.astype(b.dtype), b)  # [tm, tn]
        keep = _row_mask(partial.shape, tile_ref[item], lo_ref[item], hi_ref[item], block_rows)
        acc_ref[...] += jnp.where(keep, partial, 0.0)

    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _prefetch_args(work: WorkList, layer: jax.Array) -> tuple[jax.Array, ...]:
    return (work.tile, work.slot, work.row_lo, work.row_hi, work.rank, work.is_first, layer)


_NUM_PREFETCH = 7  # the work list's six arrays and the layer index


def _weight_spec(is_stacked: bool, block: tuple[int, int], block_index) -> pl.BlockSpec:
    """BlockSpec of one slot's [rows, cols] weight block; block_index(grid ids, prefetch refs) -> (slot, i, j).
    A stacked buffer adds the prefetched layer index in front."""
    if not is_stacked:
        return pl.BlockSpec((None, *block), lambda *ids: block_index(*ids))
    return pl.BlockSpec((None, None, *block), lambda *ids: (ids[-1][0], *block_index(*ids)))


def _sort_rows(values: jax.Array, sort_perm: jax.Array, num_rows_padded: int, num_cols_padded: int) -> jax.Array:
    sorted_values = values[sort_perm]
    return jnp.pad(sorted_values, ((0, num_rows_padded - values.shape[0]), (0, num_cols_padded - values.shape[1])))


def _unsort_rows(sorted_values: jax.Array, sort_perm: jax.Array) -> jax.Array:
    num_rows = sort_perm.shape[0]
    out = jnp.zeros((num_rows,) + sorted_values.shape[1:], sorted_values.dtype)
    return out.at[sort_perm].set(sorted_values[:num_rows], unique_indices=True)


@functools.partial(jax.jit, static_argnames=("rank_block", "block_rows", "block_in", "interpret"))
def sgmv_shrink_tpu(
    x: jax.Array,  # [T, in]
    lora_a: jax.Array,  # [A, R, in], or [L, A, R, in] with `layer`
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    layer: jax.Array | None = None,  # i32 scalar: which layer of a stacked lora_a
    *,
    rank_block: int | None = None,
    block_rows: int = 128,
    block_in: int = 1024,
    interpret: bool = False,
) -> jax.Array:
    """[T, R] float32: x_t @ A[slot_t].T for every token, reading only the adapters in the segments.

    rank_block: A's rows come in blocks of this size (R, or the per-part R of packed modules); columns at or
    above the slot's rank within a block are zeroed. None: only rank-0 (base) slots are skipped.
    """
    num_tokens, in_dim = x.shape
    is_stacked, layer_arg = layer_operand(lora_a, layer)
    max_rank = lora_a.shape[-2]
    in_padded = _round_up(in_dim, _LANES)
    lora_a, is_stacked, layer_arg = _lane_padded(lora_a, is_stacked, layer_arg, -1, in_padded)
    tm = _row_block(num_tokens, block_rows)
    tk = _lane_block(in_padded, block_in)
    rows_padded = _round_up(max(num_tokens, 1), tm)
    work = make_work_list(seg_start, seg_slot, slot_rank, num_tokens, tm)
    x_sorted = _sort_rows(x, sort_perm, rows_padded, in_padded)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=_NUM_PREFETCH,
        grid=(work.num_items, in_padded // tk),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda w, k, tile, slot, *_: (tile[w], k)),
            _weight_spec(is_stacked, (max_rank, tk), lambda w, k, tile, slot, *_: (slot[w], 0, k)),
        ],
        out_specs=pl.BlockSpec((tm, max_rank), lambda w, k, tile, slot, *_: (tile[w], 0)),
    )
    out_sorted = pl.pallas_call(
        functools.partial(_shrink_kernel, block_rows=tm, rank_block=rank_block),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((rows_padded, max_rank), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(*_prefetch_args(work, layer_arg), x_sorted, lora_a)
    return _unsort_rows(out_sorted, sort_perm)


def expand_weights_view(lora_b: jax.Array) -> tuple[jax.Array, bool]:
    """(lora_b as `sgmv_expand_tpu` should read it, rank_major). The TPU runtime swaps an array's two minor dims in
    its layout when that pads fewer lanes (128 a tile), so a [.., out, R] B whose rank is not a multiple of 128 sits
    in HBM as [.., R, out]: its swapaxes is a bitcast, where the kernel's [tn, R] blocks of the array as given would
    make XLA copy the whole (layer-stacked) B into a lane-padded row-major layout every step. A rank that is a
    multiple of 128 is row-major already and read as given. (libtpu's choices for these shapes are asserted in the
    `tpu_compile` tests: no copy of a B stack at ranks 8 to 128.)"""
    if lora_b.shape[-1] % _LANES == 0:
        return lora_b, False
    return jnp.swapaxes(lora_b, -1, -2), True


@functools.partial(jax.jit, static_argnames=("out_dtype", "rank_major", "block_rows", "block_out", "interpret"))
def sgmv_expand_tpu(
    s: jax.Array,  # [T, R] f32
    lora_b: jax.Array,  # [A, out, R] ([A, R, out] rank_major), or [L, A, ...] with `layer`
    sort_perm: jax.Array,  # [T] i32
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    layer: jax.Array | None = None,  # i32 scalar: which layer of a stacked lora_b
    *,
    out_dtype: jnp.dtype,
    rank_major: bool = False,
    block_rows: int = 128,
    block_out: int = 512,
    interpret: bool = False,
) -> jax.Array:
    """[T, out] out_dtype: s_t @ B[slot_t].T for every token, reading only the adapters in the segments.

    rank_major: lora_b is given as B transposed, [.., R, out] (`expand_weights_view`), the out dim in lanes."""
    num_tokens, max_rank = s.shape
    is_stacked, layer_arg = layer_operand(lora_b, layer)
    out_axis = -1 if rank_major else -2
    out_dim = lora_b.shape[out_axis]
    out_padded = _round_up(out_dim, _LANES)
    lora_b, is_stacked, layer_arg = _lane_padded(lora_b, is_stacked, layer_arg, out_axis, out_padded)
    tm = _row_block(num_tokens, block_rows)
    tn = _lane_block(out_padded, block_out)
    rows_padded = _round_up(max(num_tokens, 1), tm)
    work = make_work_list(seg_start, seg_slot, slot_rank, num_tokens, tm)
    s_sorted = _sort_rows(s.astype(jnp.float32), sort_perm, rows_padded, max_rank)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=_NUM_PREFETCH,
        grid=(out_padded // tn, work.num_items),
        in_specs=[
            pl.BlockSpec((tm, max_rank), lambda n, w, tile, slot, *_: (tile[w], 0)),
            _weight_spec(is_stacked, (max_rank, tn), lambda n, w, tile, slot, *_: (slot[w], 0, n))
            if rank_major
            else _weight_spec(is_stacked, (tn, max_rank), lambda n, w, tile, slot, *_: (slot[w], n, 0)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda n, w, tile, slot, *_: (tile[w], n)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out_sorted = pl.pallas_call(
        functools.partial(_expand_kernel, block_rows=tm, rank_major=rank_major),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((rows_padded, out_padded), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(*_prefetch_args(work, layer_arg), s_sorted, lora_b)
    return _unsort_rows(out_sorted[:, :out_dim], sort_perm)
