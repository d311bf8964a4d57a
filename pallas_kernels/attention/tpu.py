"""Ragged paged attention for TPU (Pallas Mosaic): decode rows and prefill chunks of many sequences in one call.

Where it sits: `sgl_jax_lora.layers.attention.paged_attention` calls it once per layer per step (backend
`pallas_tpu`; `pallas_interpret` on CPU) with the whole K/V caches [L, K, N, D] and the layer index, after the
step's K/V were written (kv_write_tpu.py on a TPU); it computes what `reference.ragged_paged_attention_ref` computes. On CPU it runs in
interpret mode (`pltpu.InterpretParams`), which is how the tests check it.

Layout. The query heads of one GQA group are folded into rows: q [T, H, D] becomes [K, T * G, D] with row
t * G + g, so one K/V page block read for kv head k serves all G query heads of that head. The grid is
(q block, kv head); a q block is a fixed run of `num_queries_per_block` tokens, i.e. a [BQ * G, D] tile.

Ragged queries. A q block may hold tokens of several sequences (many decode rows, or the tail of one chunk and
the head of the next). The first and last sequence of each block (tpu_layout.py `block_sequences`) are the same in
every layer: the model builds them once per forward as a `TpuAttentionPlan` and passes it to each call (`plan=`); a
call given none computes them in jit from cu_q_lens. They are scalar-prefetched into SMEM with the layer index,
kv_lens, the flattened page table and cu_q_lens. The kernel loops over those sequences; for each it runs a flash
(online softmax, float32) pass over the sequence's keys up to the causal limit of its last row in this block, with
the rows of other sequences masked, then writes its rows of the output tile. Tokens past cu_q_lens[S] belong to no sequence and stay zero.

K/V reads. The caches stay in HBM (`pl.ANY`). For each block of `num_kv_pages_per_block` pages the kernel DMAs
one [page_size, D] slab per page of this layer and kv head into a VMEM buffer [pages * page_size, D]; two buffers
alternate, so the DMA of the next page block overlaps the math on the current one. Pages past the causal limit
are not read, so VMEM rows past it hold stale data: scores and values there are masked before use. With a sliding
window (`sliding_window`, scalar-prefetched beside the layer) the kv blocks wholly below the window of a sequence's
first row in the q block are skipped, and the pages below it in its first kv block are not DMAed.

TPU tiling: a page slab is [page_size, D], so page_size must be a multiple of the cache dtype's sublane tile
(8 for 32-bit, 16 for bf16, 32 for an 8-bit cache, whose slabs are widened to q's dtype before the products) and D
a multiple of 128; q tiles need BQ * G to be a multiple of q's sublane tile.
These are checked when not interpreting. D cannot be padded here: padding the cache would copy it every call.

Not done: the first page block of the next sequence is not prefetched while the current one finishes, and a
decode-heavy q block computes BQ * G score rows per sequence where only G are used (memory, not compute, bounds
decode). The whole page table sits in SMEM (S * P int32), which bounds S * P by the chip's SMEM. On CPU the
kernel is tested in interpret mode and compiled by libtpu for TPU slices (no TPU needed: the tpu_compile tests); its
speed on a TPU is unmeasured (no TPU here).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.tpu_layout import (
    LANES,
    Tiling,
    TpuAttentionPlan,
    choose_tiling,
    num_q_blocks,
    plan_ragged_attention_tpu,
    round_up,
    sublane_tile,
)

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(mask - mask) stays 1, never NaN


@dataclasses.dataclass(frozen=True)
class _KernelRefs:
    """The kernel's refs, bundled so helpers take one argument instead of fifteen."""

    layer: jax.Array  # SMEM [1]
    window: jax.Array | None  # SMEM [1], the sliding window; None: every key up to each query's own
    kv_lens: jax.Array  # SMEM [S]
    page_table: jax.Array  # SMEM [S * P]
    cu_q_lens: jax.Array  # SMEM [S + 1]
    q: jax.Array  # VMEM [BQ * G, D]
    k_hbm: jax.Array  # HBM [L, K, N, D]
    v_hbm: jax.Array  # HBM [L, K, N, D]
    out: jax.Array  # VMEM [BQ * G, D]
    k_buf: jax.Array  # VMEM [2, pages_per_kv_block * page_size, D]
    v_buf: jax.Array  # VMEM [2, pages_per_kv_block * page_size, D]
    sems: jax.Array  # DMA semaphores [2 (k, v), 2 (buffer)]
    row_max: jax.Array  # VMEM [BQ * G, 128] f32, running max (same value in every lane)
    row_sum: jax.Array  # VMEM [BQ * G, 128] f32, running softmax denominator
    acc: jax.Array  # VMEM [BQ * G, D] f32, running numerator


def _dot(lhs: jax.Array, rhs: jax.Array, contract_rhs: int) -> jax.Array:
    """lhs [M, C] with rhs [N, C] (contract_rhs=1) or [C, N] (contract_rhs=0), float32 result."""
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        lhs, rhs, (((1,), (contract_rhs,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _page_copies(refs: _KernelRefs, t: Tiling, seq, kv_block, slot, page_in_block):
    """DMA descriptors (k, v) of one page of the sequence's kv block into buffer `slot`."""
    page_index = kv_block * t.pages_per_kv_block + page_in_block
    page = refs.page_table[seq * t.pages_per_seq + page_index]
    layer, kv_head = refs.layer[0], pl.program_id(1)
    src = pl.ds(page * t.page_size, t.page_size)
    dst = pl.ds(page_in_block * t.page_size, t.page_size)
    k = pltpu.make_async_copy(refs.k_hbm.at[layer, kv_head, src], refs.k_buf.at[slot, dst], refs.sems.at[0, slot])
    v = pltpu.make_async_copy(refs.v_hbm.at[layer, kv_head, src], refs.v_buf.at[slot, dst], refs.sems.at[1, slot])
    return k, v


def _for_pages_in_block(refs: _KernelRefs, t: Tiling, seq, kv_block, slot, num_keys, lowest_key, action: str) -> None:
    """Start (or wait for) the DMAs of the pages of a kv block that hold keys in [lowest_key, num_keys)."""

    def body(page_in_block, carry):
        first_key = (kv_block * t.pages_per_kv_block + page_in_block) * t.page_size

        @pl.when((first_key < num_keys) & (first_key + t.page_size > lowest_key))
        def _():
            for copy in _page_copies(refs, t, seq, kv_block, slot, page_in_block):
                getattr(copy, action)()

        return carry

    jax.lax.fori_loop(0, t.pages_per_kv_block, body, 0)


def _flash_update(refs: _KernelRefs, slot, mask: jax.Array, key_is_loaded: jax.Array, scale: float) -> None:
    """One online-softmax step of all rows over the kv block in buffer `slot`; masked scores count for nothing."""
    k, v = refs.k_buf[slot], refs.v_buf[slot]  # [KB, D]
    if jnp.dtype(k.dtype).itemsize == 1:  # an 8-bit cache (--kv-cache-dtype fp8_*): products in q's dtype
        k, v = k.astype(refs.q.dtype), v.astype(refs.q.dtype)
    v = jnp.where(key_is_loaded, v, 0)  # stale VMEM rows may hold NaN; 0 * NaN would leak
    scores = jnp.where(mask, _dot(refs.q[...], k, 1) * scale, _MASK_VALUE)  # [R, KB]
    max_prev = refs.row_max[...]  # [R, 128]
    max_new = jnp.maximum(max_prev, jnp.max(scores, axis=1, keepdims=True))
    probs = jnp.where(mask, jnp.exp(scores - max_new[:, :1]), 0.0)
    rescale = jnp.exp(max_prev - max_new)
    refs.row_max[...] = max_new
    refs.row_sum[...] = rescale * refs.row_sum[...] + jnp.sum(probs, axis=1, keepdims=True)
    refs.acc[...] = refs.acc[...] * rescale[:, :1] + _dot(probs.astype(v.dtype), v, 0)


def _rows_in_range(shape: tuple[int, int], row_lo, row_hi) -> jax.Array:
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (row >= row_lo) & (row < row_hi)


def _attend_sequence(refs: _KernelRefs, t: Tiling, seq, scale: float) -> None:
    """Flash attention of this q block's rows of sequence `seq` over its keys; writes those rows of the output.

    Row r of the tile is token block_start + r // G. Masks compare rows with scalar bounds instead of dividing
    vectors: key_pos <= first_pos + r // G  <=>  (key_pos - first_pos) * G <= r, and a sliding window W's
    key_pos > first_pos + r // G - W  <=>  (key_pos - first_pos + W) * G > r. The kv blocks wholly below the
    window of the sequence's first row in the block are not read.
    """
    block_start = pl.program_id(0) * t.tokens_per_q_block
    q_start, q_end = refs.cu_q_lens[seq], refs.cu_q_lens[seq + 1]
    token_lo = jnp.maximum(q_start, block_start)
    token_hi = jnp.minimum(q_end, block_start + t.tokens_per_q_block)

    @pl.when(token_hi > token_lo)
    def _():
        position_offset = refs.kv_lens[seq] - q_end  # token i of the sequence sits at position offset + i
        num_keys = position_offset + token_hi  # causal limit of the block's last row of this sequence
        num_kv_blocks = jax.lax.div(num_keys + t.keys_per_kv_block - 1, t.keys_per_kv_block)
        # the first key any row of the block reads: the window's of its first row (0 without a window)
        lowest_key = 0 if refs.window is None else jnp.maximum(position_offset + token_lo - refs.window[0] + 1, 0)
        first_kv_block = jax.lax.div(lowest_key, t.keys_per_kv_block)
        row_lo, row_hi = (token_lo - block_start) * t.group, (token_hi - block_start) * t.group
        refs.row_max[...] = jnp.full_like(refs.row_max, _MASK_VALUE)
        refs.row_sum[...] = jnp.zeros_like(refs.row_sum)
        refs.acc[...] = jnp.zeros_like(refs.acc)
        pages = functools.partial(_for_pages_in_block, refs, t, seq, num_keys=num_keys, lowest_key=lowest_key)
        pages(first_kv_block, jax.lax.rem(first_kv_block, 2), action="start")

        def kv_step(kv_block, carry):
            slot = jax.lax.rem(kv_block, 2)
            pages(kv_block, slot, action="wait")

            @pl.when(kv_block + 1 < num_kv_blocks)
            def _():
                pages(kv_block + 1, 1 - slot, action="start")

            first_key = kv_block * t.keys_per_kv_block
            score_shape = (t.rows, t.keys_per_kv_block)
            key_from_row0 = first_key - position_offset - block_start  # key position minus row 0's position
            key_pos_rel = key_from_row0 + jax.lax.broadcasted_iota(jnp.int32, score_shape, 1)
            row = jax.lax.broadcasted_iota(jnp.int32, score_shape, 0)
            mask = _rows_in_range(score_shape, row_lo, row_hi) & (key_pos_rel * t.group <= row)
            if refs.window is not None:
                mask &= (key_pos_rel + refs.window[0]) * t.group > row
            value_shape = refs.v_buf.shape[1:]
            key = first_key + jax.lax.broadcasted_iota(jnp.int32, value_shape, 0)
            key_is_loaded = (key < num_keys) & (key >= lowest_key)
            _flash_update(refs, slot, mask, key_is_loaded, scale)
            return carry

        jax.lax.fori_loop(first_kv_block, num_kv_blocks, kv_step, 0)
        result = (refs.acc[...] / refs.row_sum[...][:, :1]).astype(refs.out.dtype)  # other rows: 0/0, dropped
        refs.out[...] = jnp.where(_rows_in_range(refs.out.shape, row_lo, row_hi), result, refs.out[...])


def _kernel(*refs, tiling: Tiling, scale: float, windowed: bool):
    # scalar prefetch: layer, [window,] kv_lens, page_table, cu_q_lens, block_first_seq, block_last_seq
    refs = list(refs)
    layer, window = refs.pop(0), refs.pop(0) if windowed else None
    kv_lens, page_table, cu_q_lens, block_first_seq, block_last_seq = refs[:5]
    kernel_refs = _KernelRefs(layer, window, kv_lens, page_table, cu_q_lens, *refs[5:])
    kernel_refs.out[...] = jnp.zeros_like(kernel_refs.out)  # padding tokens and empty blocks give zeros
    block = pl.program_id(0)

    def per_seq(seq, carry):
        _attend_sequence(kernel_refs, tiling, seq, scale)
        return carry

    jax.lax.fori_loop(block_first_seq[block], block_last_seq[block] + 1, per_seq, 0)


def _check_inputs(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    page_size: int,
) -> None:
    num_heads, head_dim = q.shape[1:]
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"ragged_paged_attention_tpu: caches must both be [L, K, N, D={head_dim}], got "
            f"{k_cache.shape} and {v_cache.shape}"
        )
    if num_heads % k_cache.shape[1]:
        raise ValueError(
            f"ragged_paged_attention_tpu: {num_heads} query heads are not a multiple of {k_cache.shape[1]} kv heads"
        )
    if k_cache.shape[2] % page_size:
        raise ValueError(
            f"ragged_paged_attention_tpu: cache slots {k_cache.shape[2]} are not whole pages of {page_size}"
        )
    if kv_lens.shape != page_table.shape[:1] or cu_q_lens.shape != (page_table.shape[0] + 1,):
        raise ValueError(
            f"ragged_paged_attention_tpu: kv_lens {kv_lens.shape}, page_table {page_table.shape} "
            f"and cu_q_lens {cu_q_lens.shape} disagree on the number of sequences"
        )


def _check_tpu_tiling(q: jax.Array, k_cache: jax.Array, t: Tiling) -> None:
    """Shapes Mosaic cannot tile raise here, before lowering, with the fix."""
    head_dim = q.shape[2]
    fix = "serve with --attention-backend native, or a model whose head_dim is a multiple of 128"
    if head_dim % LANES:
        raise ValueError(
            f"TPU ragged paged attention: head_dim {head_dim} is not a multiple of 128 "
            f"(a K/V page slab is [page_size, head_dim] in lanes); {fix}"
        )
    cache_tile = sublane_tile(k_cache.dtype)
    if t.page_size % cache_tile:
        raise ValueError(
            f"TPU ragged paged attention: page_size {t.page_size} is not a multiple of "
            f"{cache_tile} ({k_cache.dtype} sublane tile); restart with --page-size "
            f"{round_up(t.page_size, cache_tile)}, or {fix}"
        )
    q_tile = sublane_tile(q.dtype)
    if t.rows % q_tile:
        raise ValueError(
            f"TPU ragged paged attention: num_queries_per_block {t.tokens_per_q_block} x "
            f"{t.group} query heads per kv head = {t.rows} rows, not a multiple of {q_tile}; "
            f"pick num_queries_per_block so the product is, or leave it None"
        )


def _plan_block_tokens(plan: TpuAttentionPlan, num_queries_per_block: int | None, num_tokens: int) -> int:
    """The call's BQ from a plan: the plan's, which a given num_queries_per_block must equal."""
    bq = plan.tokens_per_q_block
    if num_queries_per_block not in (None, bq) or plan.block_first_seq.shape != (num_q_blocks(num_tokens, bq),):
        raise ValueError(
            f"ragged_paged_attention_tpu: the plan holds {plan.block_first_seq.shape} q blocks of {bq} tokens, not "
            f"the layout of this call ({num_tokens} tokens, num_queries_per_block={num_queries_per_block}); build it "
            "with plan_ragged_attention_tpu for the same step and q tile"
        )
    return bq


@functools.partial(
    jax.jit,
    static_argnames=("page_size", "scale", "num_kv_pages_per_block", "num_queries_per_block", "interpret"),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, D]
    v_cache: jax.Array,  # [L, K, N, D]
    layer: jax.Array,  # [] i32
    kv_lens: jax.Array,  # [S] i32   tokens of each sequence in the cache, this step's included
    page_table: jax.Array,  # [S, P] i32
    cu_q_lens: jax.Array,  # [S+1] i32 cumulative query lengths; cu_q_lens[0] = 0
    *,
    page_size: int,
    scale: float,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    interpret: bool = False,
    plan: TpuAttentionPlan | None = None,
    sliding_window: jax.Array | int | None = None,
) -> jax.Array:
    """-> [T, H, D] in q's dtype, as `ragged_paged_attention_ref`; K/V pages read in place from the caches.

    num_kv_pages_per_block: pages per K/V DMA block (default: 512 keys, fewer for short page tables). Only
        pages below a row's causal limit are read, so a block may reach past P.
    num_queries_per_block: tokens per q tile, BQ (default: BQ * G about 128 rows, at most T rounded up).
    interpret: run on CPU with the TPU interpreter (tests).
    plan: the step's q-block layout from `plan_ragged_attention_tpu` (tpu_layout.py), built once per forward; its
        BQ is the call's. None: built in this call.
    sliding_window: the keys a query attends to, its own included ([] i32, traced: a layer's); pages below a
        q block's window are not read. None: every key up to the query's own.
    """
    _check_inputs(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens, page_size)
    if plan is not None:
        num_queries_per_block = _plan_block_tokens(plan, num_queries_per_block, q.shape[0])
    tiling = choose_tiling(q, k_cache, page_table, page_size, num_kv_pages_per_block, num_queries_per_block)
    if not interpret:
        _check_tpu_tiling(q, k_cache, tiling)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    bq, rows = tiling.tokens_per_q_block, tiling.rows
    num_blocks = num_q_blocks(num_tokens, bq)
    padded_tokens = num_blocks * bq

    q_rows = q.reshape(num_tokens, num_kv_heads, tiling.group, head_dim)
    q_rows = jnp.pad(q_rows, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * tiling.group, head_dim)
    if plan is None:
        plan = plan_ragged_attention_tpu(
            cu_q_lens, num_tokens=num_tokens, group=tiling.group, q_dtype=q.dtype, num_queries_per_block=bq
        )
    first_seq, last_seq = plan.block_first_seq, plan.block_last_seq
    kv_buffer = pltpu.VMEM((2, tiling.keys_per_kv_block, head_dim), k_cache.dtype)

    windows = () if sliding_window is None else (jnp.asarray(sliding_window, jnp.int32).reshape(1),)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6 + len(windows),
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, rows, head_dim), lambda b, h, *_: (h, b, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, rows, head_dim), lambda b, h, *_: (h, b, 0)),
        scratch_shapes=[
            kv_buffer,
            kv_buffer,
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, head_dim), jnp.float32),
        ],
    )
    out_rows = pl.pallas_call(
        functools.partial(_kernel, tiling=tiling, scale=scale, windowed=bool(windows)),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        *windows,
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        first_seq,
        last_seq,
        q_rows,
        k_cache,
        v_cache,
    )
    out = out_rows.reshape(num_kv_heads, padded_tokens, tiling.group, head_dim).transpose(1, 0, 2, 3)
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim)
