"""Base GEMM without LoRA for prefill on Hopper GPUs (Pallas on Mosaic GPU): y = x @ W[layer].

Where it sits: the decoder layers' linears (layers/base_gemm.py, called from `Linear.base`) in prefill buckets from
`--gpu-gemm-min-tokens` tokens, in place of XLA's `jnp.dot` on the layer's slice of the [L, in, out] weight stack.
This kernel reads the layer's rows of the stack in place; given the slice, XLA may hand its GEMM library a copy of
the layer's W first (a device-to-device copy per layer and module).

The kernel is `_kernel` of gemm_lora_gpu.py with `has_lora=False`: the same persistent grid over the SMs, the same
two consumer warpgroups side by side along N, the same `stages`-deep TMA pipeline of x and W tiles and the same TMA
epilogue, with no s or B tiles in shared memory, no entry tables among its operands and no LoRA loop after the K
loop. Its scalar operands are the first row of the layer's W in the flattened [L * in, out] stack and the step's
real row count (the row tiles of a bucket's padding are skipped and their rows zeroed, by a select after the kernel,
`zero_rows_from`, which `zero_padding=False` leaves out for a consumer that masks those rows itself).

Split K, for decode-sized T: with few CTA tiles ((T / tile_m) x (out / 2 tile_n), 32 for the o and down modules
of Llama-3-8B at 256 tokens) most of the GPU's SMs would idle through a long K loop. `choose_k_splits` then cuts the
K loop into up to 8 equal parts so that tiles x parts still fit one wave over the SMs; each CTA writes its part's
float32 product to a [k_splits * T, out] buffer (32-column epilogue stores: the bytes of 64 bf16 columns) and XLA
sums the parts and rounds once to x's dtype.

Tail split, for the buckets between: where the tiles make a few whole waves and a partial one (q|k|v of Llama-3-8B
at 751 real rows: 144 tiles on 132 SMs), the partial wave's tiles run in pieces of their K loop that add into a
zeroed output (tail_split.py); the real row count decides the pieces inside the kernel (`default_tail_split` says
where).

Gated, for a packed [gate | up] module (`gated=True`): the epilogue computes the MLP's silu(gate) * up and writes
[T, I], not the [T, 2I] product that XLA's activation would read back (layers/linear.py `silu_and_mul`).

What exists here: `choose_gemm_tiles` (the deepest pipeline that fits shared memory without the LoRA tiles),
`default_k_splits` (gemm_lora_gpu.py's `choose_k_splits` with those tiles on this GPU), `default_tail_split`,
`check_gemm_shapes`, `gemm_gpu_rows` (the kernel call, `base_kernel_call`, and the sum of split K's parts) and
`gemm_gpu` (checks, tiles, splits, and the pure-JAX reference for platforms without Mosaic GPU). Needs: T a multiple
of tile_m, in a multiple of tile_k, out a multiple of 2 * tile_n, bf16 operands (a bf16 WGMMA) of one dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sgmv.gemm_lora_gpu import (
    GemmLoraTiles,
    _kernel,
    choose_gemm_lora_tiles,
    choose_k_splits,
    persistent_kernel,
    rows_operand,
    silu_and_mul,
    zero_rows_from,
)
from pallas_kernels.sgmv.tail_split import modeled_saving


def is_hopper(device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.x (WGMMA and TMA: the Mosaic GPU GEMM kernels)."""
    return device.platform in ("gpu", "cuda") and str(getattr(device, "compute_capability", "0")).startswith("9")


def choose_gemm_tiles(k_splits: int = 1, gated_delta: bool = False) -> GemmLoraTiles:
    """The tiles of the LoRA kernel's choice with no LoRA tiles in shared memory (rank 0): 4 stages and 64-column
    epilogue stores; with split K, 32-column stores of the float32 parts (the same shared memory); for the gated
    kernel with a delta, 3 stages and 32-column stores beside the delta's tiles."""
    if gated_delta:
        return choose_gemm_lora_tiles(0, gated_delta=True)
    tiles = choose_gemm_lora_tiles(0)
    if k_splits > 1:
        tiles = dataclasses.replace(tiles, epilogue_n=32)
        assert tiles.smem_bytes(0, out_itemsize=4) == choose_gemm_lora_tiles(0).smem_bytes(0)
    return tiles


def default_k_splits(num_tokens: int, in_dim: int, out_dim: int) -> int:
    """The parts `gemm_gpu` cuts the K loop into when not told: `choose_k_splits` with the default tiles over this
    GPU's SMs; 1 off GPUs (a device without a core count)."""
    num_sms = getattr(jax.devices()[0], "core_count", 0)
    return choose_k_splits(num_tokens, in_dim, out_dim, choose_gemm_tiles(), num_sms) if num_sms else 1


TAIL_SPLIT_MAX_TOKENS = 1024  # token buckets up to this size may run the tail split ...
TAIL_SPLIT_MAX_OUT = 8192  # ... in modules up to this many columns (zeroing a wider output costs what the tail gains)
TAIL_SPLIT_MIN_SAVING = 0.05  # ... where the tile model saves at least this share of the K steps (`modeled_saving`)


def default_tail_split(num_tokens: int, in_dim: int, out_dim: int, k_splits: int, num_sms: int = 0) -> bool:
    """Whether `gemm_gpu` cuts the last partial wave's tiles in pieces of K when not told (tail_split.py): in
    decode-sized buckets whose K loop is not split already, for modules of at most TAIL_SPLIT_MAX_OUT columns
    where `modeled_saving` over the bucket's row counts reaches TAIL_SPLIT_MIN_SAVING. On an H200 that is q|k|v and
    down of Llama-3-8B in the 1024 bucket and q|k|v in the 512 one; o's tail is one piece at most of its row counts,
    where zeroing its output only costs time. num_sms: this GPU's (0: read from it; off GPUs, never)."""
    num_sms = num_sms or getattr(jax.devices()[0], "core_count", 0)
    if not num_sms or k_splits != 1 or num_tokens > TAIL_SPLIT_MAX_TOKENS or out_dim > TAIL_SPLIT_MAX_OUT:
        return False
    tiles = choose_gemm_tiles()
    saving = modeled_saving(num_tokens, in_dim, out_dim, tiles.tile_m, 2 * tiles.tile_n, tiles.tile_k, num_sms)
    return saving >= TAIL_SPLIT_MIN_SAVING


def check_gemm_shapes(
    num_tokens: int, in_dim: int, out_dim: int, tiles: GemmLoraTiles, cta_n: int | None = None
) -> None:
    """Raises ValueError, naming the fix, when the shapes do not fit the kernel's tiles. cta_n: the output columns
    of a CTA tile (2 * tile_n; tile_n for the gated kernel's [T, I] output)."""
    cta_n = cta_n or 2 * tiles.tile_n
    if num_tokens % tiles.tile_m or in_dim % tiles.tile_k or out_dim % cta_n:
        raise ValueError(
            f"gemm_gpu: T={num_tokens}, in={in_dim}, out={out_dim} do not fit tiles {tiles}: T must be a multiple of "
            f"{tiles.tile_m}, in of {tiles.tile_k} and out of {cta_n}; pad the batch, or use XLA's dot for this module"
        )


def base_kernel_call(
    x: jax.Array,
    w_rows: jax.Array,
    w_row: jax.Array,
    num_rows: jax.Array,
    *,
    tiles: GemmLoraTiles,
    num_sms: int,
    k_splits: int = 1,
    tail_split: bool = False,
    gated: bool = False,
    delta: jax.Array | None = None,
    interpret=None,
) -> jax.Array:
    """`gemm_gpu_rows`' kernel on a grid of `num_sms` CTAs, its own output: [k_splits * T, out] (float32 parts with
    k_splits > 1); with `gated`, [T, out / 2] silu(gate) * up, its padding's row tiles zeroed by the kernel (with
    `delta` [T, out], silu(gate + delta_gate) * (up + delta_up)); with
    `tail_split`, [T, out], the pieces added into an output XLA zeroes first (a GMEM ref the kernel reads and
    writes). interpret: Mosaic GPU interpreter params (CPU tests)."""
    body = functools.partial(
        _kernel,
        tiles=tiles,
        has_lora=False,
        k_splits=k_splits,
        tail_split=tail_split,
        gated=gated,
        gated_delta=delta is not None,
        num_sms=num_sms,
    )
    if tail_split:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        out = jax.new_ref(jnp.zeros((x.shape[0], w_rows.shape[1]), x.dtype), memory_space=plgpu.GMEM)
        pl.kernel(
            body,
            out_type=(),
            mesh=plgpu.Mesh(grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg"),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            interpret=interpret,
        )(w_row, num_rows, x, w_rows, out)
        return out[...]
    num_tokens, out_dim = x.shape[0], w_rows.shape[1] // (2 if gated else 1)
    out_dtype = x.dtype if k_splits == 1 else jnp.float32
    out_type = jax.ShapeDtypeStruct((k_splits * num_tokens, out_dim), out_dtype)
    operands = (x, w_rows) if delta is None else (x, w_rows, delta)
    return persistent_kernel(body, out_type, num_sms, interpret)(w_row, num_rows, *operands)


@functools.partial(jax.jit, static_argnames=("tiles", "k_splits", "tail_split", "gated"))
def gemm_gpu_rows(
    x: jax.Array,  # [T, in] bf16
    w_rows: jax.Array,  # [L * in, out] bf16: a layer stack of W flattened (L = 1 for one W)
    w_row: jax.Array,  # [1] i32: the first row of the layer's W in w_rows
    num_rows: jax.Array,  # [1] i32: the rows of x to compute (the rest are padding)
    delta: jax.Array | None = None,  # [T, out] x's dtype, gated only: added to [gate | up] before the activation
    *,
    tiles: GemmLoraTiles,
    k_splits: int = 1,
    tail_split: bool = False,
    gated: bool = False,
) -> jax.Array:
    """x @ W in one kernel ([T, out], x's dtype; with k_splits > 1 the kernel's float32 parts summed by XLA); its
    rows from num_rows[0] on are not computed (any values: `zero_rows_from`). The shapes as `check_gemm_shapes`
    requires, in / tile_k a multiple of k_splits. tail_split (with k_splits 1): the last partial wave's tiles in
    pieces of K (tail_split.py), added into a zeroed output. gated (with k_splits 1): W is [gate | up] and the
    result [T, out / 2] is silu(x @ W_gate) * (x @ W_up), the activation in the kernel's epilogue."""
    num_tokens, out_dim = x.shape[0], w_rows.shape[1]
    num_sms = jax.devices()[0].core_count
    options = dict(tiles=tiles, num_sms=num_sms, k_splits=k_splits, tail_split=tail_split, gated=gated)
    y = base_kernel_call(x, w_rows, w_row, num_rows, delta=delta, **options)
    if k_splits == 1:
        return y
    return y.reshape(k_splits, num_tokens, out_dim).sum(axis=0).astype(x.dtype)


def gemm_gpu(
    x: jax.Array,  # [T, in]
    w: jax.Array,  # [in, out], or the [L, in, out] stack with `layer`
    layer: jax.Array | None = None,
    num_rows: jax.Array | None = None,
    *,
    tiles: GemmLoraTiles | None = None,
    k_splits: int | None = None,
    tail_split: bool | None = None,
    gated: bool = False,
    delta: jax.Array | None = None,
    reference: bool = False,
    zero_padding: bool = True,
) -> jax.Array:
    """y = x @ W (layer `layer` of a stack, read in place) in x's dtype, accumulated in float32; with `gated`, W's
    columns are [gate | up] (I each) and y = silu(x @ W_gate) * (x @ W_up) [T, I], applied in the kernel's epilogue
    (one K loop per tile: no split K, no tail split). delta ([T, 2I] in x's dtype, gated only): y = silu(x @ W_gate
    + delta_gate) * (x @ W_up + delta_up), each product rounded to x's dtype before the add and the sum after it, as
    the unfused layers add a LoRA delta; the kernel reads it in its epilogue (the default tiles: 3 stages).

    num_rows ([1] i32): the rows of x that are real (a token bucket's padding follows them); the kernel skips the
    row tiles after them and y is zero from row num_rows[0] on (gated: zero from the end of its row tile on, the
    rows before that the padding x's activation, as the next GEMM kernel given num_rows ignores them and no select
    pass is spent on them). None: every row. zero_padding (not gated): False leaves out the select that zeroes y's
    rows from num_rows[0] on (`zero_rows_from`), so they hold any values (the kernel leaves the skipped row tiles
    unwritten; NaN possible), for a consumer that masks them itself (the rotary + K/V write kernel after q|k|v);
    gated outputs are as above either way. k_splits: parts of the K loop
    (None: `choose_k_splits` for this GPU's SMs with the default tiles; 1 when `tiles` are given or off GPUs).
    tail_split: the last partial wave's tiles in pieces of K (tail_split.py; None: `default_tail_split` when neither
    tiles nor k_splits are given, else off). reference: compute it with the pure-JAX `x @ w[layer]` instead of the
    kernel, on platforms without Mosaic GPU (CPU tests of the code around the kernel); the shapes are checked either
    way. The reference computes every row: with zero_padding=False it returns the padding rows' products, as the
    kernel returns its rows unwritten (so CPU tests of the consumer see non-zero padding)."""
    in_dim, out_dim = w.shape[-2:]
    automatic = k_splits is None and tiles is None and not reference and not gated
    if k_splits is None:
        k_splits = 1 if tiles is not None or reference or gated else default_k_splits(x.shape[0], in_dim, out_dim)
    if tail_split is None:
        tail_split = automatic and default_tail_split(x.shape[0], in_dim, out_dim, k_splits)
    if (tail_split or gated) and k_splits != 1:
        raise ValueError(
            f"gemm_gpu: the tail split and the gated kernel run one K loop per tile, not {k_splits} parts; "
            "pass k_splits=1"
        )
    if tail_split and gated:
        raise ValueError("gemm_gpu: gated runs without the tail split; pass tail_split=False")
    if delta is not None and (not gated or delta.shape != (x.shape[0], out_dim) or delta.dtype != x.dtype):
        raise ValueError(
            f"gemm_gpu: a delta is added before the gated kernel's activation: pass gated=True and a delta of shape "
            f"{(x.shape[0], out_dim)} in {x.dtype}, not {None if delta is None else (delta.shape, delta.dtype)}"
        )
    tiles = tiles or choose_gemm_tiles(k_splits, gated_delta=delta is not None)
    if x.shape[1] != in_dim or x.dtype != w.dtype:
        raise ValueError(f"gemm_gpu: x {x.shape} {x.dtype} does not match W {w.shape} {w.dtype}")
    check_gemm_shapes(
        x.shape[0], in_dim, out_dim // 2 if gated else out_dim, tiles, cta_n=tiles.tile_n if gated else None
    )
    if (in_dim // tiles.tile_k) % k_splits:
        raise ValueError(
            f"gemm_gpu: {in_dim // tiles.tile_k} K steps do not split into {k_splits} equal parts; pass a k_splits "
            "that divides them, or None for choose_k_splits"
        )
    if reference:
        w_layer = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        y = jnp.dot(x, w_layer, preferred_element_type=jnp.float32).astype(x.dtype)
        y = y if delta is None else y + delta
        y = silu_and_mul(y) if gated else y
        return zero_rows_from(y, num_rows) if gated or zero_padding else y
    w_row = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer * in_dim, (1,)).astype(jnp.int32)
    rows = rows_operand(num_rows, x.shape[0])
    y = gemm_gpu_rows(
        x,
        w.reshape(-1, out_dim),
        w_row,
        rows,
        delta,
        tiles=tiles,
        k_splits=k_splits,
        tail_split=tail_split,
        gated=gated,
    )
    return zero_rows_from(y, num_rows) if zero_padding and not gated else y
