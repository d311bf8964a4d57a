"""Base GEMM with the LoRA expand inside it, for prefill on Hopper GPUs (Pallas on Mosaic GPU).

Where it sits: the Pallas LoRA backend's prefill path on Hopper GPUs (lora/backend/pallas_gpu.py `apply_with_base`,
called by LoRALinear for prefill buckets from `--lora-fused-gemm-min-tokens` tokens), in place of XLA's
`x @ W` followed by the SGMV expand. The shrink (s = x @ A[slot].T, which reads x once) stays the SGMV shrink
kernel of `gpu.py`; this kernel computes, for each packed part p of the module (q|k|v, gate|up; one part
otherwise) in its columns of y,

    y_p = x @ W_p + (scale[slot_t] * s_p,t) @ B_p[slot_t].T      for every token t

in one pass over y. At prefill sizes the GEMM is compute-bound, so the expand's extra MMA steps cost a few
percent of its time, while an expand outside the GEMM must read and write y again (2 x T x out bytes).

How the LoRA enters the GEMM: the tokens of one output row tile (`tile_m` rows) belong to a few runs of
consecutive tokens with the same adapter slot (a prefill batch holds each sequence's tokens together).
`build_entry_table` (entry_table.py) cuts the tokens into entries, one per (row tile, run) pair (once per batch), and
`entry_s` lays the scaled s out per entry as an [E, tile_m, R] array whose rows outside the entry's run are
zero (once per layer). After the tile's K loop over
x and W, the kernel adds, for each entry of its row tile, s_entry [tile_m, R] @ B[slot].T [R, tile_n] into
the same float32 accumulator: R more K steps per run, with the first entries' operands fetched by TMA while the
main loop runs. The entries of a tile run one after the other, so with one buffer each waits for its operands' trip
to memory (about 1 us an entry on an H200 when many adapters' B tiles miss L2); `entry_slots` buffers make a ring
with that many entries' tiles in flight. Entries of base tokens (scale 0) are dropped. Rows of a run never meet
another run's B, so no masking is needed inside the kernel, and any number of runs per tile is handled (bounded by
E, static).

Packed parts and layers: each part's width is a multiple of a CTA's 2 * tile_n columns, so a CTA's columns
lie in one part (`part_tile_tables`) and it fetches that part's B and s columns; W and every B may be layer
stacks ([L, ...], as the model holds them), read in place at the layer's offset, so no layer's weight is copied.

The GEMM: persistent over the SMs, two consumer warpgroups side by side along N (each [tile_m, tile_n]),
one producer warpgroup streaming x and W tiles through a `stages`-deep TMA pipeline
(`emit_pipeline_warp_specialized`), and a TMA epilogue of 64 x `epilogue_n` stores. A token bucket's padding costs
no tile: the kernel takes the step's real row count as data and runs only the row tiles that hold real rows, spread
over the SMs as if the bucket ended there (a decode step of 345 rows in the 512 bucket runs 3 of 4 row tiles); the
rows after the real ones are zeroed by `zero_rows_from`, a select XLA fuses into the output's consumer or the split-K
sum. The q|k|v projection skips it where its consumer is the rotary + K/V write kernel
(pallas_kernels/attention/kv_write_gpu.py: a Pallas call, into which XLA cannot fuse the select, so it would be a pass
of its own over [T, out]): that kernel masks the padding rows itself, and the callers pass `zero_padding=False` down
to here (models/llama.py). Needs: T a multiple of tile_m, in a multiple of tile_k, each part's width a multiple of
2 * tile_n, R a multiple of 16 (a bf16 WGMMA's K) up to 64, bf16 operands. `gemm_lora_entries_ref` (reference.py)
computes the same from the same operands in pure JAX.
TPU has no counterpart yet (the Mosaic TPU SGMV kernels run outside the GEMM there). With `gated=True` the module is
gate|up and the kernel writes the MLP's silu(gate) * up (a CTA tile of 128 rows by tile_n columns, each consumer
warpgroup 64 rows in a gate and an up accumulator, adding its half of each entry into both before the activation).
With `has_lora=False` (no s or B tiles, no LoRA loop) the same kernel is the plain base GEMM of gemm_gpu.py (gated
there too without adapters), and with `fp8=True` as well the 8-bit GEMM of gemm_fp8_gpu.py (8-bit x and a
K-major W, the accumulator scaled in the epilogue). `persistent_kernel` is the one grid every variant launches on
(gemm_skinny_gpu.py's too, which also shares `smem_transforms` and the SMEM_BYTES budget);
`lora_kernel_call` the call of the kernel with LoRA (CPU tests pass it the Mosaic GPU interpreter); `silu_and_mul` the
unfused activation the gated kernels match.

Split K, at decode sizes: where a module's CTA tiles leave most SMs idle (o and down of Llama-3-8B at 512 tokens:
64 tiles on 132 SMs), the K loop is cut into parts as in the base GEMM (`choose_k_splits`); each part's CTA writes
its float32 product to a [k_splits * T, out] buffer that XLA sums, and the parts' CTAs share the tile's LoRA
entries, each adding its own consecutive slice of them, so the sum holds each entry once and a row tile of many
entries spreads them over its parts. `choose_gemm_lora_split` picks the parts and the tiles with float32
epilogue stores that fit shared memory beside the LoRA tiles (one pipeline stage fewer at rank 16).

The tail split (`tail_split=True`, the base GEMM of gemm_gpu.py only): the tiles of the last partial wave over the
SMs run in pieces of their K loop that TMA reduce-add into a zeroed output (tail_split.py); the K loop of a unit then
has a dynamic start and length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sgmv.entry_table import EntryTable, entry_s_parts
from pallas_kernels.sgmv.tail_split import tail_pieces, unit_work

SMEM_BYTES = 227 * 1024  # H100 shared memory per block
SMEM_SPARE = 1024  # barriers and the pipeline's bookkeeping


def smem_transforms(minor: int, dtype) -> tuple:
    """The tiling and swizzle of a shared-memory tile whose minor dimension holds `minor` elements of `dtype`: rows of
    8, the widest swizzle the row's bytes allow (what TMA and the WGMMA read)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


@dataclasses.dataclass(frozen=True)
class GemmLoraTiles:
    tile_m: int = 128  # rows of a CTA tile (and of an entry)
    tile_n: int = 128  # columns per consumer warpgroup; a CTA tile is 2 * tile_n wide
    tile_k: int = 64
    stages: int = 4  # TMA pipeline depth of x and W tiles
    epilogue_n: int = 64  # columns of an epilogue store (its rows: 64)
    snake_minor_n: bool = True  # tile order: snake along N (else along M) ...
    snake_width: int = 8  # ... in bands this many tiles wide
    entry_slots: int = 1  # LoRA entries whose s and B tiles are in flight at once: a ring of buffers per warpgroup

    def smem_bytes(
        self, rank: int, out_itemsize: int = 2, in_itemsize: int = 2, gated: bool = False, gated_delta: bool = False
    ) -> int:
        pipeline = self.stages * (self.tile_m * self.tile_k + self.tile_k * 2 * self.tile_n) * in_itemsize
        epilogue = 2 * 2 * 64 * self.epilogue_n * out_itemsize  # two warpgroups, two slots
        if gated_delta:  # per warpgroup: its rows of the delta's gate and up columns (16-bit)
            epilogue += 2 * 2 * (self.tile_m // 2) * self.tile_n * 2
        if gated:  # per warpgroup: gate's and up's s tiles of its half of the rows, and their B tiles
            lora = 2 * 2 * (self.tile_m // 2 + self.tile_n) * rank * 2
        else:  # per warpgroup: an s tile and a B tile
            lora = 2 * (self.tile_m + self.tile_n) * rank * 2
        return pipeline + epilogue + lora * self.entry_slots


def choose_gemm_lora_tiles(
    rank: int,
    out_itemsize: int = 2,
    tile_n: int = 128,
    max_stages: int = 4,
    gated: bool = False,
    entry_slots: int = 1,
    gated_delta: bool = False,
) -> GemmLoraTiles:
    """The deepest pipeline, of at most `max_stages`, that fits shared memory with this rank's LoRA tiles (narrower
    epilogue stores before fewer stages: a stage less costs more than twice the stores). out_itemsize 4: the float32
    parts of split K, stored 32 columns (128 bytes) at a time. tile_n: the columns per consumer warpgroup. gated:
    the tiles of the gated kernel with LoRA (gate's and up's s and B tiles; at rank 16 four stages with 16-column
    stores). entry_slots: the LoRA entries in flight at once, each with its own s and B tiles; a ring that leaves
    fewer than MIN_RING_STAGES stages gets one slot fewer (at rank 16, two slots take three stages). gated_delta:
    the gated base GEMM's tiles with its delta tiles (rank 0: three stages with 32-column stores)."""
    for slots in range(entry_slots, 0, -1):
        for stages in range(max_stages, 1 if slots == 1 else MIN_RING_STAGES - 1, -1):
            for epilogue_n in (64, 32, 16) if out_itemsize == 2 else (32,):
                tiles = GemmLoraTiles(tile_n=tile_n, stages=stages, epilogue_n=epilogue_n, entry_slots=slots)
                if (
                    tiles.smem_bytes(rank, out_itemsize, gated=gated, gated_delta=gated_delta) + SMEM_SPARE
                    <= SMEM_BYTES
                ):
                    return tiles
    raise ValueError(
        f"gemm_lora_gpu: no tiles fit shared memory at rank {rank}; use the SGMV kernels (ranks above 64) instead"
    )


MAX_K_SPLITS = 8
MIN_SPLIT_STAGES = 3  # split K with LoRA tiles only where the float32 epilogue leaves this deep a pipeline
MIN_RING_STAGES = 3  # a ring of LoRA entry buffers only where it leaves this deep a pipeline


def choose_k_splits(num_tokens: int, in_dim: int, out_dim: int, tiles: GemmLoraTiles, num_sms: int) -> int:
    """The most parts (1, 2, 4 or 8) the K loop may be cut into so that CTA tiles x parts fit one wave over
    `num_sms` SMs, each part a whole number of at least `tiles.stages` K steps; 1 when the tiles alone fill half
    the SMs or more."""
    num_tiles = (num_tokens // tiles.tile_m) * (out_dim // (2 * tiles.tile_n))
    k_steps = in_dim // tiles.tile_k
    best = 1
    if 2 * num_tiles > num_sms:
        return best
    for parts in (2, 4, MAX_K_SPLITS):
        if num_tiles * parts <= num_sms and k_steps % parts == 0 and k_steps // parts >= tiles.stages:
            best = parts
    return best


def choose_gemm_lora_split(
    num_tokens: int, in_dim: int, out_dim: int, rank: int, num_sms: int, entry_slots: int = 1
) -> tuple[GemmLoraTiles, int]:
    """The tiles and K parts of the GEMM with the LoRA inside it over `num_sms` SMs: `choose_k_splits` with this
    rank's tiles (with a ring of `entry_slots` entry buffers where it fits); when it splits, the tiles with float32
    epilogue stores, unless they leave fewer than MIN_SPLIT_STAGES stages (then one part)."""
    tiles = choose_gemm_lora_tiles(rank, entry_slots=entry_slots)
    k_splits = choose_k_splits(num_tokens, in_dim, out_dim, tiles, num_sms) if num_sms else 1
    if k_splits == 1:
        return tiles, 1
    split_tiles = choose_gemm_lora_tiles(rank, out_itemsize=4, entry_slots=entry_slots)
    if split_tiles.stages < MIN_SPLIT_STAGES:
        return tiles, 1
    return split_tiles, choose_k_splits(num_tokens, in_dim, out_dim, split_tiles, num_sms)


def _kernel(
    *refs,
    tiles: GemmLoraTiles,
    has_lora: bool = True,
    k_splits: int = 1,
    fp8: bool = False,
    tail_split: bool = False,
    num_sms: int = 0,
    gated: bool = False,
    gated_delta: bool = False,
):
    """The kernel body. refs: (w_row, num_rows, tile_part, tile_part_col, entry_start, entry_slot, x, w, s, *bs,
    out); with has_lora False (gemm_gpu.py) only (w_row, num_rows, x, w, out): no s or B tiles in shared memory and
    no LoRA loop; with gated_delta as well (w_row, num_rows, x, w, delta, out). num_rows ([1] i32): the rows of x to
    compute; the row tiles wholly after them (a bucket's padding) are not run and their rows of out are left
    unwritten (the callers zero them, `zero_rows_from`), and the tiles that run are spread over the SMs as if the
    bucket ended at the last of them.
    k_splits > 1: each CTA tile runs over one of k_splits equal parts of the K loop and writes its float32 partial
    product at rows split * T.. of out ([k_splits * T, out]); the caller sums the parts. Part i's tile adds the
    entries first + n * i // k_splits .. first + n * (i + 1) // k_splits of the row tile's n, so each once.
    fp8 (gemm_fp8_gpu.py, no LoRA): refs (w_row, num_rows, w_scales, scale, x, w, out) with 8-bit float x [T, in] and
    W stored K-major, [L * out, in] (an 8-bit WGMMA reads both operands K-major), w_row the first row of the layer's W
    there; each row of the float32 accumulator is multiplied by its scale (scale [T] f32, the row tile's copied into
    shared memory while the K loop runs) and by the layer's W scale (w_scales [L] f32, at w_row // out; [1]: the
    W's whatever the layer) before it is stored.
    tail_split (gemm_gpu.py, no LoRA, one K part; `num_sms` the grid's size): the tiles of the last partial wave run
    in pieces of their K loop (tail_split.py) that add into out with TMA reduce-adds; out must start at zero.
    gated (one K part, no fp8): W's columns are [gate | up], each I wide, and out [T, I] is
    silu(x @ W_gate) * (x @ W_up) (each product rounded to x's dtype first, as the unfused layers do): a CTA tile
    is tile_m rows by tile_n columns of out, whose gate and up columns the producer fetches as two [tile_k, tile_n]
    blocks; each consumer warpgroup holds half the rows in two accumulators, gate and up (the same registers and
    shared-memory reads as one [tile_m, tile_n] accumulator), and stores the activated product. With has_lora the
    module has two parts, gate and up; before the activation each entry adds gate's and up's s rows of the
    warpgroup's half @ their B columns into the two accumulators (tile_part and tile_part_col are not read).
    The gated output's consumer is the next layer GEMM, a kernel XLA cannot fuse a select into, so the gated kernel
    zeroes the padding's row tiles itself (units after the real tiles that only store zeros) instead of leaving
    them to `zero_rows_from`: its rows from num_rows[0] to the end of that row tile hold the padding x's activation,
    and every row after is zero.
    gated_delta (gated, has_lora False): delta [T, 2I] in W's [gate | up] columns (the LoRA delta the SGMV kernels
    computed before this GEMM) is added to the rounded gate and up products before the activation, each sum rounded
    to x's dtype as the unfused layers add it; each warpgroup's rows of the tile's two delta blocks arrive in shared
    memory while its K loop runs."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    w_row_ref, num_rows_ref = refs[:2]
    if has_lora:
        tile_part_ref, tile_part_col_ref, entry_start_ref, entry_slot_ref, x_ref, w_ref, s_ref = refs[2:9]
        b_refs, out_ref = refs[9:-1], refs[-1]
        rank, num_entries = s_ref.shape[-1], s_ref.shape[0] // len(b_refs)
    elif fp8:
        w_scales_ref, scale_ref, x_ref, w_ref, out_ref = refs[2:]
    elif gated_delta:
        x_ref, w_ref, delta_ref, out_ref = refs[2:]
    else:
        x_ref, w_ref, out_ref = refs[2:]
    (num_tokens, in_dim), out_dim = x_ref.shape, out_ref.shape[1]
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    cta_n = tn if gated else 2 * tn  # the columns of out a CTA tile computes
    n_tiles, k_steps = out_dim // cta_n, in_dim // tk
    m_tiles = jnp.clip((num_rows_ref[0] + tm - 1) // tm, 0, num_tokens // tm)  # the row tiles that run
    k_len = in_dim // k_splits  # the K columns of one split
    em_rows, en_cols = 64, tiles.epilogue_n

    def transforms(minor: int, dtype=x_ref.dtype):
        return smem_transforms(minor, dtype)

    assert not tail_split or (num_sms and k_splits == 1 and not has_lora and not fp8)
    assert not gated or (k_splits == 1 and not fp8 and not tail_split and (not has_lora or len(b_refs) == 2))
    assert not gated_delta or (gated and not has_lora)
    acc_rows = tm // 2 if gated else tm  # the rows of a consumer warpgroup's accumulator ([acc_rows, tn])

    def pipeline(body, compute_context, num_steps=k_steps // k_splits, k_first=0):
        """The K loop over `num_steps` steps from step k_first of the views it is called on (a dynamic count and
        start with tail_split)."""
        if fp8:  # W K-major: a [cta_n, tk] block of its rows (the CTA's output columns)
            w_blocks = [((cta_n, tk), lambda k: (0, k + k_first))]
        elif gated:  # the gate block and the up block
            w_blocks = [((tk, tn), lambda k: (k + k_first, 0))] * 2
        else:
            w_blocks = [((tk, cta_n), lambda k: (k + k_first, 0))]
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (tm, tk), lambda k: (0, k + k_first), transforms=transforms(tk), memory_space=plgpu.SMEM
                ),
                *(
                    plgpu.BlockSpec(*w_block, transforms=transforms(tk), memory_space=plgpu.SMEM)
                    for w_block in w_blocks
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiles.stages,
            compute_context=compute_context,
        )

    unused = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies
    lora_allocs = {}
    lora_parts = 2 if gated else 1  # the parts whose entries a warpgroup adds: gate and up, or its columns' part
    slots = tiles.entry_slots  # the ring: entry i of a row tile uses slot i % slots
    if has_lora:  # per warpgroup, slot and part an s tile of its rows and a B tile of its columns, each with a barrier
        lora_allocs = dict(
            s_smem=plgpu.SMEM((2, slots, lora_parts, acc_rows, rank), s_ref.dtype, transforms=transforms(rank)),
            b_smem=plgpu.SMEM((2, slots, lora_parts, tn, rank), b_refs[0].dtype, transforms=transforms(rank)),
            lora_barriers=plgpu.Barrier(num_barriers=2 * slots * 2 * lora_parts),
        )
    delta_allocs = {}
    if gated_delta:  # per warpgroup and part (gate, up) its rows of the tile's delta block, each with a barrier
        delta_allocs = dict(
            delta_smem=plgpu.SMEM((2, 2, acc_rows, tn), delta_ref.dtype, transforms=transforms(tn, delta_ref.dtype)),
            delta_barriers=plgpu.Barrier(num_barriers=4),
        )
    scale_allocs = {}
    if fp8:  # per warpgroup the row tile's scales, and the barrier they arrive on
        scale_allocs = dict(scale_smem=plgpu.SMEM((2, tm), jnp.float32), scale_barriers=plgpu.Barrier(num_barriers=2))

    if fp8:
        w_views_shape = [w_ref.at[pl.ds(0, cta_n), pl.ds(0, k_len)]]
    elif gated:
        w_views_shape = [w_ref.at[pl.ds(0, k_len), pl.ds(0, tn)]] * 2
    else:
        w_views_shape = [w_ref.at[pl.ds(0, k_len), :]]

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(unused, unused).get_allocations(x_ref.at[:, pl.ds(0, k_len)], *w_views_shape),
        out_smem=plgpu.SMEM((2, 2, em_rows, en_cols), out_ref.dtype, transforms=transforms(en_cols, out_ref.dtype)),
        **lora_allocs,
        **delta_allocs,
        **scale_allocs,
        collective_axes="wg",
    )
    def scope(
        pipeline_allocs,
        out_smem,
        s_smem=None,
        b_smem=None,
        lora_barriers=None,
        delta_smem=None,
        delta_barriers=None,
        scale_smem=None,
        scale_barriers=None,
    ):
        wg = jax.lax.axis_index("wg")

        def slot_barriers(slot):
            """This warpgroup's barriers of a ring slot: the s tiles' (one per part), then the B tiles'."""
            return [lora_barriers.at[(wg * slots + slot) * 2 * lora_parts + i] for i in range(2 * lora_parts)]

        num_tiles = m_tiles * n_tiles
        if tail_split:  # whole waves of tiles, then the rest in pieces of K (tail_split.py)
            whole_tiles = num_tiles // num_sms * num_sms
            remaining_tiles = num_tiles - whole_tiles
            pieces = tail_pieces(remaining_tiles, num_sms, k_steps)
            num_units = whole_tiles + remaining_tiles * pieces
        else:
            num_units = k_splits * num_tiles
        if gated:  # the padding's row tiles, zeroed after the real ones
            num_units += (num_tokens // tm - m_tiles) * n_tiles

        @plgpu.nd_loop((num_units,), collective_axes="sm")
        def tile_loop(loop_info):
            (linear,) = loop_info.index
            is_piece, k_first, num_steps = False, 0, k_steps // k_splits
            if tail_split:
                linear, k_first, k_end, is_piece = unit_work(linear, whole_tiles, remaining_tiles, pieces, k_steps)
                split, num_steps = 0, k_end - k_first
            else:
                split, linear = linear // num_tiles, linear % num_tiles
            is_zero_tile = False
            if gated:
                is_zero_tile = loop_info.index[0] >= num_tiles
                zero_tile = loop_info.index[0] - num_tiles
            mi, ni = plgpu.planar_snake(linear, (m_tiles, n_tiles), 1 if tiles.snake_minor_n else 0, tiles.snake_width)
            if gated:  # a zero tile's row tile is past the real ones
                mi = jnp.where(is_zero_tile, m_tiles + zero_tile // n_tiles, mi)
                ni = jnp.where(is_zero_tile, zero_tile % n_tiles, ni)
            cta_rows = pl.ds(mi * tm, tm)
            cta_cols = pl.ds(ni * cta_n, cta_n)
            if gated:  # a warpgroup's half of the rows, all the CTA's columns
                wg_out = out_ref.at[pl.ds(mi * tm + wg * acc_rows, acc_rows), cta_cols]
            else:  # all the rows (at the split's offset with split K), a warpgroup's half of the columns
                wg_out = out_ref.at[pl.ds(split * num_tokens + mi * tm, tm), pl.ds(ni * cta_n + wg * tn, tn)]
            if has_lora:
                first, end = entry_start_ref[mi], entry_start_ref[mi + 1]
                if k_splits > 1:  # each part adds its own slice of the entries: the parts' sum holds each once
                    base, count = first, end - first
                    first = base + jax.lax.div(count * split, k_splits)
                    end = base + jax.lax.div(count * (split + 1), k_splits)
                if gated:  # gate's and up's columns of the tile, the same in both parts; the warpgroup's rows
                    part_cols = pl.ds(pl.multiple_of(ni * tn, tn), tn)
                    s_rows = pl.ds(pl.multiple_of(wg * acc_rows, acc_rows), acc_rows)
                else:  # the packed part this CTA's columns lie in, and where they start in it
                    part = tile_part_ref[ni]
                    part_cols = pl.ds(pl.multiple_of(tile_part_col_ref[ni], cta_n) + wg * tn, tn)  # TMA tiling

            def fetch(entry, slot):
                """The entry's s and B tiles into ring slot `slot`, each arriving on that slot's barrier."""
                adapter = entry_slot_ref[entry]
                barriers = slot_barriers(slot)
                s_barriers, b_barriers = barriers[:lora_parts], barriers[lora_parts:]
                s_slot, b_slot = s_smem.at[wg, slot], b_smem.at[wg, slot]
                if gated:
                    for index, b_ref in enumerate(b_refs):
                        s_entry = s_ref.at[index * num_entries + entry, s_rows]
                        plgpu.copy_gmem_to_smem(s_entry, s_slot.at[index], s_barriers[index])
                        plgpu.copy_gmem_to_smem(b_ref.at[adapter, part_cols, :], b_slot.at[index], b_barriers[index])
                    return
                plgpu.copy_gmem_to_smem(s_ref.at[part * num_entries + entry], s_slot.at[0], s_barriers[0])
                if len(b_refs) == 1:
                    plgpu.copy_gmem_to_smem(b_refs[0].at[adapter, part_cols, :], b_slot.at[0], b_barriers[0])
                    return
                for index, b_ref in enumerate(b_refs):

                    @pl.when(part == index)
                    def _fetch_part(b_ref=b_ref):
                        plgpu.copy_gmem_to_smem(b_ref.at[adapter, part_cols, :], b_slot.at[0], b_barriers[0])

            def add_entries(accs):
                """After the K loop: each entry of the row tile adds its s rows @ B columns into the accumulator
                of its part (gated: gate's and up's). Entry i waits in slot i % slots; once its MMAs are done, the
                slot takes entry i + slots, so `slots` entries' tiles are in flight while one computes."""

                @pl.loop(first, end)
                def _lora(entry):
                    slot = 0 if slots == 1 else jax.lax.rem(entry - first, slots)
                    for barrier in slot_barriers(slot):
                        plgpu.barrier_wait(barrier)
                    for index, acc in enumerate(accs):
                        b_tile = b_smem.at[wg, slot, index].transpose((1, 0))
                        plgpu.wgmma(acc, s_smem.at[wg, slot, index], b_tile)
                    plgpu.wgmma_wait(0)

                    @pl.when(entry + slots < end)
                    def _next():
                        fetch(entry + slots, slot)

            def compute_context(eval_pipeline):
                if fp8:  # the row tile's scales arrive while the K loop runs
                    plgpu.copy_gmem_to_smem(scale_ref.at[cta_rows], scale_smem.at[wg], scale_barriers.at[wg])
                if has_lora:  # the first entries' operands arrive while the K loop runs, one per slot
                    for ahead in range(slots):

                        @pl.when(first + ahead < end)
                        def _prefetch(ahead=ahead):
                            fetch(first + ahead, ahead)

                if gated_delta:  # the warpgroup's rows of the gate and up delta blocks arrive while the K loop runs
                    delta_rows = pl.ds(mi * tm + wg * acc_rows, acc_rows)
                    for part in range(2):
                        delta_cols = pl.ds(part * out_dim + ni * tn, tn)
                        barrier = delta_barriers.at[wg * 2 + part]
                        plgpu.copy_gmem_to_smem(delta_ref.at[delta_rows, delta_cols], delta_smem.at[wg, part], barrier)
                if gated:

                    @functools.partial(
                        pl.run_scoped,
                        gate_ref=plgpu.ACC((acc_rows, tn), jnp.float32),
                        up_ref=plgpu.ACC((acc_rows, tn), jnp.float32),
                    )
                    def gated_scope(gate_ref, up_ref):
                        eval_pipeline((gate_ref, up_ref))
                        if has_lora:
                            add_entries((gate_ref, up_ref))
                        gate = gate_ref[...].astype(out_ref.dtype).astype(jnp.float32)
                        up = up_ref[...].astype(out_ref.dtype).astype(jnp.float32)
                        if gated_delta:
                            for part in range(2):
                                plgpu.barrier_wait(delta_barriers.at[wg * 2 + part])
                            gate = rounded_sum(gate, delta_smem[wg, 0])
                            up = rounded_sum(up, delta_smem[wg, 1])
                        store_tile((gate * jax.nn.sigmoid(gate) * up).astype(out_ref.dtype))

                    return

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def acc_scope(acc_ref):
                    eval_pipeline(acc_ref)

                    if has_lora:
                        add_entries((acc_ref,))
                    acc = acc_ref[...]
                    if fp8:  # each row's scale (its x row's), and the layer W's
                        plgpu.barrier_wait(scale_barriers.at[wg])
                        w_layer = 0 if w_scales_ref.shape[0] == 1 else jax.lax.div(w_row_ref[0], out_dim)
                        w_scale = w_scales_ref[w_layer]
                        row_scales = scale_smem[wg] * w_scale
                        acc = acc * jax.lax.broadcast_in_dim(row_scales, acc.shape, (0,))
                    store_tile(acc.astype(out_ref.dtype))

            def rounded_sum(product, delta):
                return (product + delta.astype(jnp.float32)).astype(out_ref.dtype).astype(jnp.float32)

            def store_tile(acc):
                """This warpgroup's [acc_rows, tn] of out, in em_rows x en_cols pieces through two smem slots."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for em in range(acc_rows // em_rows):
                    for en in range(tn // en_cols):
                        slot = (em * (tn // en_cols) + en) % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = acc[em * em_rows : (em + 1) * em_rows, en * en_cols : (en + 1) * en_cols]
                        plgpu.commit_smem()
                        store = functools.partial(
                            plgpu.copy_smem_to_gmem,
                            out_smem.at[wg, slot],
                            wg_out.at[pl.ds(em * em_rows, em_rows), pl.ds(en * en_cols, en_cols)],
                        )
                        if not tail_split:
                            store()
                            continue
                        pl.when(is_piece)(lambda store=store: store(reduction_op="add"))
                        pl.when(jnp.logical_not(is_piece))(store)

            def mma_gated(_, x_smem, w_gate_smem, w_up_smem, accs):
                x_rows = x_smem.at[pl.ds(wg * acc_rows, acc_rows)]
                plgpu.wgmma(accs[0], x_rows, w_gate_smem)
                plgpu.wgmma(accs[1], x_rows, w_up_smem)
                plgpu.wgmma_wait(0)
                return accs

            def mma(_, x_smem, w_smem, acc_ref):
                if fp8:  # this warpgroup's rows of the K-major block, read as a [tk, tn] operand
                    plgpu.wgmma(acc_ref, x_smem, w_smem.at[pl.ds(wg * tn, tn), :].transpose((1, 0)))
                else:
                    plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * tn, tn)])
                plgpu.wgmma_wait(0)
                return acc_ref

            # the split's K columns of x, and the layer's W: its rows of the [L * in, out] stack, or (fp8) the
            # CTA's output rows of the K-major [L * out, in] stack and the split's K columns
            x_cols = pl.ds(split * k_len, k_len)
            w_rows = pl.ds(pl.multiple_of(w_row_ref[0] + split * k_len, tk), k_len)
            if fp8:
                w_views = [w_ref.at[pl.ds(pl.multiple_of(w_row_ref[0] + ni * cta_n, cta_n), cta_n), x_cols]]
            elif gated:  # the tile's gate columns and its up columns, out_dim further on
                w_views = [w_ref.at[w_rows, cta_cols], w_ref.at[w_rows, pl.ds(out_dim + ni * cta_n, cta_n)]]
            else:
                w_views = [w_ref.at[w_rows, cta_cols]]
            run_pipeline = pipeline(mma_gated if gated else mma, compute_context, num_steps, k_first)
            if not gated:
                run_pipeline(x_ref.at[cta_rows, x_cols], *w_views, allocations=pipeline_allocs)
                return

            @pl.when(jnp.logical_not(is_zero_tile))
            def _product():
                run_pipeline(x_ref.at[cta_rows, x_cols], *w_views, allocations=pipeline_allocs)

            @pl.when(is_zero_tile & (wg < 2))  # the consumer warpgroups store; the producer has nothing to do
            def _zeros():
                store_tile(jnp.zeros((acc_rows, tn), out_ref.dtype))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def persistent_kernel(body, out_type: jax.ShapeDtypeStruct, num_sms: int, interpret=None):
    """`body` (a `_kernel` partial) as a Mosaic GPU kernel of one CTA per SM (`num_sms`), each with two consumer
    warpgroups and a producer, in warpgroup semantics: the call every GEMM of this family makes. interpret: Mosaic
    GPU interpreter params (CPU tests)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )


def zero_rows_from(y: jax.Array, num_rows: jax.Array | None) -> jax.Array:
    """y with its rows from num_rows[0] on set to zero (the rows a kernel given `num_rows` left unwritten); y as it
    is when num_rows is None (every row computed). XLA fuses the select into y's consumer where it can."""
    if num_rows is None:
        return y
    return jnp.where(jnp.arange(y.shape[0], dtype=jnp.int32)[:, None] < num_rows[0], y, jnp.zeros((), y.dtype))


def silu_and_mul(y: jax.Array) -> jax.Array:
    """[T, 2 * I] = [gate | up] -> silu(gate) * up [T, I] in y's dtype (what the unfused layers compute)."""
    gate, up = jnp.split(y, 2, axis=-1)
    return jax.nn.silu(gate) * up


def rows_operand(num_rows: jax.Array | None, num_tokens: int) -> jax.Array:
    """The kernels' `num_rows` operand ([1] i32): num_rows, or all `num_tokens` rows when it is None."""
    return jnp.full((1,), num_tokens, jnp.int32) if num_rows is None else num_rows


def part_tile_tables(part_widths: tuple[int, ...], cta_n: int) -> tuple[np.ndarray, np.ndarray]:
    """For each CTA column tile of a packed output [part 0 | part 1 | ...]: the part it lies in, and the column
    in that part where it starts (each part's width must be a multiple of cta_n)."""
    if any(width % cta_n for width in part_widths):
        raise ValueError(
            f"gemm_lora_gpu: part widths {part_widths} must each be a multiple of {cta_n} columns (a CTA tile never "
            "spans two parts); use the SGMV kernels for this module"
        )
    tile_part = np.concatenate([np.full(width // cta_n, i, np.int32) for i, width in enumerate(part_widths)])
    tile_part_col = np.concatenate([np.arange(0, width, cta_n, dtype=np.int32) for width in part_widths])
    return tile_part, tile_part_col


def check_gemm_lora_shapes(
    num_tokens: int, in_dim: int, part_widths: tuple[int, ...], rank: int, tiles: GemmLoraTiles, gated: bool = False
) -> None:
    """Raises ValueError, naming the fix, when the shapes do not fit the kernel's tiles (gated: two parts, gate and
    up, of one width, a multiple of tile_n)."""
    cta_n = tiles.tile_n if gated else 2 * tiles.tile_n
    if gated and (len(part_widths) != 2 or part_widths[0] != part_widths[1]):
        raise ValueError(
            f"gemm_lora_gpu: gated needs two parts of one width (gate, up), got widths {part_widths}; run the packed "
            "product, then the activation"
        )
    if num_tokens % tiles.tile_m or in_dim % tiles.tile_k or rank % 16 or any(w % cta_n for w in part_widths):
        raise ValueError(
            f"gemm_lora_gpu: T={num_tokens}, in={in_dim}, part widths {part_widths}, R={rank} do not fit tiles {tiles}: "
            f"T must be a multiple of {tiles.tile_m}, in of {tiles.tile_k}, each part's width of {cta_n} and R of 16; "
            "pad the batch, or use the SGMV kernels for this module"
        )


def lora_kernel_call(
    x: jax.Array,
    w_rows: jax.Array,
    w_row: jax.Array,
    num_rows: jax.Array,
    tile_part: jax.Array,
    tile_part_col: jax.Array,
    entry_start: jax.Array,
    entry_slot: jax.Array,
    s_entries: jax.Array,
    b_rows: tuple[jax.Array, ...],
    *,
    tiles: GemmLoraTiles,
    num_sms: int,
    k_splits: int = 1,
    gated: bool = False,
    interpret=None,
) -> jax.Array:
    """`gemm_lora_gpu_entries`' kernel on a grid of `num_sms` CTAs, its own output: [k_splits * T, out] (float32
    parts with k_splits > 1); with `gated`, [T, out / 2] silu(gate) * up, its padding's row tiles zeroed by the
    kernel. interpret: Mosaic GPU interpreter params (CPU tests)."""
    out_dim = w_rows.shape[1] // (2 if gated else 1)
    out_dtype = x.dtype if k_splits == 1 else jnp.float32
    return persistent_kernel(
        functools.partial(_kernel, tiles=tiles, k_splits=k_splits, gated=gated),
        jax.ShapeDtypeStruct((k_splits * x.shape[0], out_dim), out_dtype),
        num_sms,
        interpret,
    )(w_row, num_rows, tile_part, tile_part_col, entry_start, entry_slot, x, w_rows, s_entries, *b_rows)


@functools.partial(jax.jit, static_argnames=("tiles", "k_splits", "gated"))
def gemm_lora_gpu_entries(
    x: jax.Array,  # [T, in] bf16
    w_rows: jax.Array,  # [L * in, out] bf16: a layer stack of W flattened (L = 1 for one W)
    w_row: jax.Array,  # [1] i32: the first row of the layer's W in w_rows
    num_rows: jax.Array,  # [1] i32: the rows of x to compute (the rest are padding)
    tile_part: jax.Array,  # [out / (2 * tile_n)] i32: the part of each CTA column tile (part_tile_tables)
    tile_part_col: jax.Array,  # [out / (2 * tile_n)] i32: its first column within the part
    entry_start: jax.Array,  # [T / tile_m + 1] i32
    entry_slot: jax.Array,  # [E] i32, rows of the b_rows' first axis
    s_entries: jax.Array,  # [P * E, tile_m, R] bf16: part p's entries at p * E ..
    b_rows: tuple[jax.Array, ...],  # P x [slots, out_p, R] bf16 (a layer stack flattened to [L * A, out_p, R])
    *,
    tiles: GemmLoraTiles,
    k_splits: int = 1,
    gated: bool = False,
) -> jax.Array:
    """x @ W plus, for every entry, its s rows @ B_part[entry_slot].T, in one kernel ([T, out], x's dtype; with
    k_splits > 1 the kernel's float32 parts summed by XLA); its rows from num_rows[0] on are not computed (any
    values: `zero_rows_from`). gated (k_splits 1, parts gate and up): silu(gate) * up [T, out / 2], the padding's
    row tiles zero. The shapes as `check_gemm_lora_shapes` requires (gemm_lora_gpu checks them)."""
    num_tokens, out_dim = x.shape[0], w_rows.shape[1]
    options = dict(tiles=tiles, num_sms=jax.devices()[0].core_count, k_splits=k_splits, gated=gated)
    y = lora_kernel_call(
        x, w_rows, w_row, num_rows, tile_part, tile_part_col, entry_start, entry_slot, s_entries, b_rows, **options
    )
    if k_splits == 1:
        return y
    return y.reshape(k_splits, num_tokens, out_dim).sum(axis=0).astype(x.dtype)


def gemm_lora_gpu(
    x: jax.Array,  # [T, in]
    w: jax.Array,  # [in, out], or the [L, in, out] stack with `layer`
    s: jax.Array,  # [T, P * R] f32, the shrink's output in token order (part p's columns p*R .. (p+1)*R)
    table: EntryTable,
    lora_bs: jax.Array | tuple[jax.Array, ...],  # P x [A, out_p, R], or [L, A, out_p, R] stacks with `layer`
    layer: jax.Array | None = None,
    num_rows: jax.Array | None = None,
    *,
    tiles: GemmLoraTiles | None = None,
    k_splits: int = 1,
    gated: bool = False,
    reference: bool = False,
    zero_padding: bool = True,
) -> jax.Array:
    """y = x @ W + scale[slot_t] * s_t @ B_p[slot_t].T for every packed part p (its columns of y, which holds the
    parts side by side), in one GEMM kernel; the table from `build_entry_table` with tile_m = tiles.tile_m.
    gated (parts gate and up, one K part): silu(y_gate) * y_up [T, out / 2] instead, the activation in the
    kernel's epilogue (zero from the end of num_rows' row tile on, as `gemm_gpu`'s gated kernel).

    num_rows ([1] i32): the rows of x that are real; the kernel skips the row tiles after them and y is zero from
    row num_rows[0] on. None: every row. zero_padding (not gated): False leaves out that zeroing (`zero_rows_from`),
    so y's rows from num_rows[0] on hold any values (the kernel leaves the skipped row tiles unwritten; NaN possible),
    for a consumer that masks them itself; gated outputs are as above either way. k_splits: parts of the K loop
    (`choose_gemm_lora_split` gives them with their tiles; in / tile_k must be a multiple). reference: compute the
    same entries with the pure-JAX reference (`gemm_lora_entries_ref`) instead of the kernel, on platforms without
    Mosaic GPU (CPU tests of the code around the kernel); it computes every row, and zero_padding=False leaves the
    padding rows' products there, as the kernel leaves its rows unwritten (so CPU tests see non-zero padding)."""
    lora_bs = tuple(lora_bs) if isinstance(lora_bs, (tuple, list)) else (lora_bs,)
    rank = lora_bs[0].shape[-1]
    if gated and k_splits != 1:
        raise ValueError(f"gemm_lora_gpu: gated runs one K loop per tile, not {k_splits} parts; pass k_splits=1")
    tiles = tiles or choose_gemm_lora_tiles(rank, out_itemsize=2 if k_splits == 1 else 4, gated=gated)
    if table.tile_m != tiles.tile_m:
        raise ValueError(
            f"entry table of {table.tile_m}-row tiles for a {tiles.tile_m}-row kernel; build it with tile_m={tiles.tile_m}"
        )
    part_widths = tuple(b.shape[-2] for b in lora_bs)
    if sum(part_widths) != w.shape[-1] or s.shape[-1] != len(lora_bs) * rank:
        raise ValueError(
            f"gemm_lora_gpu: parts of widths {part_widths} and rank {rank} do not match W's {w.shape[-1]} columns and "
            f"s's {s.shape[-1]} columns (P * R)"
        )
    in_dim = w.shape[-2]
    check_gemm_lora_shapes(x.shape[0], in_dim, part_widths, rank, tiles, gated)
    if (in_dim // tiles.tile_k) % k_splits:
        raise ValueError(
            f"gemm_lora_gpu: {in_dim // tiles.tile_k} K steps do not split into {k_splits} equal parts; pass the "
            "k_splits of choose_gemm_lora_split"
        )
    w_row = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer * in_dim, (1,)).astype(jnp.int32)
    entry_slot = table.entry_slot if layer is None else table.entry_slot + layer * lora_bs[0].shape[-3]
    b_rows = tuple(b.reshape(-1, *b.shape[-2:]) for b in lora_bs)
    tile_part, tile_part_col = part_tile_tables(part_widths, tiles.tile_n if gated else 2 * tiles.tile_n)
    s_entries = entry_s_parts(s, table, len(lora_bs))
    operands = (
        x,
        w.reshape(-1, w.shape[-1]),
        w_row,
        rows_operand(num_rows, x.shape[0]),
        jnp.asarray(tile_part),
        jnp.asarray(tile_part_col),
        table.entry_start,
        entry_slot,
        s_entries,
        b_rows,
    )
    if reference:
        from pallas_kernels.sgmv.reference import gemm_lora_entries_ref

        x, w_rows, w_row, _, *tables = operands
        y = gemm_lora_entries_ref(x, w_rows, w_row, *tables, tile_m=table.tile_m)
        y = silu_and_mul(y) if gated else y
        return zero_rows_from(y, num_rows) if gated or zero_padding else y
    y = gemm_lora_gpu_entries(*operands, tiles=tiles, k_splits=k_splits, gated=gated)
    return zero_rows_from(y, num_rows) if zero_padding and not gated else y
