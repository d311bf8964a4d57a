"""The step's K/V written into the paged caches on TPU (Pallas Mosaic), in place, in whole sublane tiles.

Where it sits: `sgl_jax_lora.layers.attention.write_kv` calls it once per layer per step on the `pallas_tpu` backend
(`pallas_interpret` on CPU), before `ragged_paged_attention_tpu` (tpu.py) reads the layer's pages. It computes what
XLA's `cache.at[layer, :, cache_loc].set(rows)` computes.

Why a kernel. The caches [L, K, N, D] are tiled over (N, D) in HBM, the layout the attention kernel reads its
[page_size, D] slabs in. XLA's TPU scatter of single token rows wants (K, D) as the minor dims, so around each
layer's write XLA copied the whole cache into that layout and back (libtpu's compile of the forward shows the copies:
tests/sgl_jax_lora/model_executor/test_tpu_compile.py). A DMA cannot write one row of an HBM tile either: its offsets
along N must be multiples of the tile's rows (16 for bf16, 32 for 8-bit, 8 for 32-bit). So the write goes by tile
blocks: the rows of the step that fall in one block of `block` token slots are merged into it.

Flow. In XLA (small arrays): the tokens' block starts; the runs of consecutive tokens in one block (a sequence's
tokens of one step are consecutive slots, so each block touched holds one run), compacted to at most
`max_block_runs` entries (rounded up to whole groups), unused ones on block 0 of the reserved scratch page; each entry's new rows
[K, block, D] and which of its rows are new. In the kernel, a grid over groups of `BLOCKS_PER_STEP` entries: DMA the
group's blocks of this layer (K and V caches, kept in HBM with `pl.ANY` and aliased to the outputs) into VMEM, keep
the old rows where nothing new lands, DMA them back. Entries on the scratch block may race; nothing reads scratch.

What exists here: `BLOCKS_PER_STEP`, `write_block`, `max_block_runs`, `block_writes` (the XLA part) and
`write_kv_tpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.tpu_layout import sublane_tile

BLOCKS_PER_STEP = 32  # blocks whose DMAs one grid step starts together (VMEM: 2 x 32 x K x block x D)


def write_block(cache_dtype, page_size: int, interpret: bool) -> int:
    """Token slots per block: the cache dtype's sublane tile, which must divide page_size (so no block holds slots
    of two pages, two sequences' maybe); in interpret mode (no tiling) the largest power of two up to it that
    divides page_size. Raises ValueError naming --page-size otherwise."""
    tile = sublane_tile(cache_dtype)
    if page_size % tile == 0:
        return tile
    if not interpret:
        raise ValueError(
            f"TPU K/V write: page_size {page_size} is not a multiple of {tile}, the sublane tile of a "
            f"{jnp.dtype(cache_dtype).name} cache; restart with --page-size {tile}"
        )
    block = tile
    while page_size % block:
        block //= 2
    return block


def max_block_runs(num_tokens: int, num_seqs: int, block: int) -> int:
    """The most runs (consecutive tokens in one block) a step of T tokens over S sequences holds: n consecutive
    positions of a sequence span at most n // block + 2 blocks (pages are whole blocks), and the padding tokens,
    all on slot 0, one more; at most one run a token."""
    return min(num_tokens + 1, num_tokens // block + 2 * num_seqs + 1)


def block_writes(
    cache_loc: jax.Array, k: jax.Array, v: jax.Array, block: int, num_blocks: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """cache_loc [T], k and v [T, K, D] -> (each entry's first slot [B] i32, its new rows [B, K, block, D] of k and
    of v, which rows are new [B, block] i32) for B = num_blocks entries, one per run of tokens in one block."""
    num_tokens, num_kv_heads, head_dim = k.shape
    cache_loc = cache_loc.astype(jnp.int32)
    start = cache_loc - cache_loc % block
    first = jnp.concatenate([jnp.ones((1,), bool), start[1:] != start[:-1]])
    entry = jnp.cumsum(first.astype(jnp.int32)) - 1  # each token's entry; past num_blocks - 1 only if runs overflow
    starts = jnp.zeros((num_blocks,), jnp.int32).at[jnp.where(first, entry, num_blocks)].set(start, mode="drop")
    row = cache_loc % block

    def rows_into_blocks(x: jax.Array) -> jax.Array:
        placed = jnp.zeros((num_blocks, block, num_kv_heads, head_dim), x.dtype).at[entry, row].set(x, mode="drop")
        return placed.transpose(0, 2, 1, 3)

    is_new = jnp.zeros((num_blocks, block), jnp.int32).at[entry, row].set(1, mode="drop")
    return starts, rows_into_blocks(k), rows_into_blocks(v), is_new


def _kernel(layer_ref, starts_ref, new_k_ref, new_v_ref, is_new_ref, _k_in, _v_in, k_out, v_out, k_buf, v_buf, sems):
    """One grid step: BLOCKS_PER_STEP entries read from the caches, merged with their new rows, written back; K and
    V together, every DMA of a direction started before the first is awaited."""
    step, layer, block = pl.program_id(0), layer_ref[0], k_buf.shape[2]

    def copies(to_cache: bool) -> list:
        out = []
        for i in range(BLOCKS_PER_STEP):
            start = pl.multiple_of(starts_ref[step * BLOCKS_PER_STEP + i], block)
            for which, (cache, buf) in enumerate(((k_out, k_buf), (v_out, v_buf))):
                hbm, vmem = cache.at[layer, :, pl.ds(start, block), :], buf.at[i]
                src, dst = (vmem, hbm) if to_cache else (hbm, vmem)
                out.append(pltpu.make_async_copy(src, dst, sems.at[which, int(to_cache)]))
        return out

    def run(started: list) -> None:
        for copy in started:
            copy.start()
        for copy in started:
            copy.wait()

    run(copies(to_cache=False))
    keep = is_new_ref[...][:, None, :, None] == 0  # [G, 1, block, 1]
    k_buf[...] = jnp.where(keep, k_buf[...], new_k_ref[...])
    v_buf[...] = jnp.where(keep, v_buf[...], new_v_ref[...])
    run(copies(to_cache=True))


def write_kv_tpu(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_loc: jax.Array,
    *,
    page_size: int,
    num_seqs: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """k and v [T, K, D] (already in the caches' dtype) into layer `layer` of k_cache and v_cache [L, K, N, D] at
    token slots cache_loc [T], in place (the caches are aliased to the outputs; donate them to the step).
    num_seqs: the step's sequence bucket S, which bounds the blocks a step touches (`max_block_runs`). The engine's
    layout is assumed: a sequence's tokens of the step are consecutive positions, its pages page_size slots, padding
    tokens on slot 0 (the scratch page). interpret: run on CPU with the TPU interpreter (tests)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    block = write_block(k_cache.dtype, page_size, interpret)
    runs = max_block_runs(num_tokens, num_seqs, block)
    num_blocks = -(-runs // BLOCKS_PER_STEP) * BLOCKS_PER_STEP
    starts, new_k, new_v, is_new = block_writes(cache_loc, k, v, block, num_blocks)
    group = (BLOCKS_PER_STEP, num_kv_heads, block, head_dim)
    buffer = pltpu.VMEM(group, k_cache.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_blocks // BLOCKS_PER_STEP,),
        in_specs=[
            pl.BlockSpec(group, lambda g, *_: (g, 0, 0, 0)),
            pl.BlockSpec(group, lambda g, *_: (g, 0, 0, 0)),
            pl.BlockSpec((BLOCKS_PER_STEP, block), lambda g, *_: (g, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[buffer, buffer, pltpu.SemaphoreType.DMA((2, 2))],
    )
    return pl.pallas_call(
        _kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),) * 2,
        input_output_aliases={5: 0, 6: 1},  # operands: layer, starts, new k, new v, is_new, k_cache, v_cache
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.asarray(layer, jnp.int32).reshape(1), starts, new_k, new_v, is_new, k_cache, v_cache)
