"""Base GEMM without LoRA for prefill on Hopper GPUs (Pallas on Mosaic GPU): y = x @ W[layer].

Where it sits: the decoder layers' linears (layers/base_gemm.py, called from `Linear.base`) in prefill buckets from
`--gpu-gemm-min-tokens` tokens, in place of XLA's `jnp.dot` on the layer's slice of the [L, in, out] weight stack.
This kernel reads the layer's rows of the stack in place; given the slice, XLA may hand its GEMM library a copy of
the layer's W first (a device-to-device copy per layer and module).

The kernel is `_kernel` of gemm_lora_gpu.py with `has_lora=False`: the same persistent grid over the SMs, the same
two consumer warpgroups side by side along N, the same `stages`-deep TMA pipeline of x and W tiles and the same TMA
epilogue, with no s or B tiles in shared memory, no entry tables among its operands and no LoRA loop after the K
loop. Its scalar operands are the first row of the layer's W in the flattened [L * in, out] stack and the step's
real row count (the row tiles of a bucket's padding are skipped and their rows zeroed).

Split K, for decode-sized T: with few CTA tiles ((T / tile_m) x (out / 2 tile_n), 32 for the o and down modules
of Llama-3-8B at 256 tokens) most of the GPU's SMs would idle through a long K loop. `choose_k_splits` then cuts the
K loop into up to 8 equal parts so that tiles x parts still fit one wave over the SMs; each CTA writes its part's
float32 product to a [k_splits * T, out] buffer (32-column epilogue stores: the bytes of 64 bf16 columns) and XLA
sums the parts and rounds once to x's dtype.

What exists here: `choose_gemm_tiles` (the deepest pipeline that fits shared memory without the LoRA tiles),
`default_k_splits` (gemm_lora_gpu.py's `choose_k_splits` with those tiles on this GPU), `check_gemm_shapes`,
`gemm_gpu_rows` (the kernel call) and `gemm_gpu` (checks, tiles, splits, and the pure-JAX reference for platforms
without Mosaic GPU). Needs: T a multiple of tile_m, in a multiple of tile_k, out a multiple of 2 * tile_n, bf16
operands (a bf16 WGMMA) of one dtype.
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
    rows_operand,
    zero_rows_from,
)


def is_hopper(device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.x (WGMMA and TMA: the Mosaic GPU GEMM kernels)."""
    return device.platform in ("gpu", "cuda") and str(getattr(device, "compute_capability", "0")).startswith("9")


def choose_gemm_tiles(k_splits: int = 1) -> GemmLoraTiles:
    """The tiles of the LoRA kernel's choice with no LoRA tiles in shared memory (rank 0): 4 stages and 64-column
    epilogue stores; with split K, 32-column stores of the float32 parts (the same shared memory)."""
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


def check_gemm_shapes(num_tokens: int, in_dim: int, out_dim: int, tiles: GemmLoraTiles) -> None:
    """Raises ValueError, naming the fix, when the shapes do not fit the kernel's tiles."""
    cta_n = 2 * tiles.tile_n
    if num_tokens % tiles.tile_m or in_dim % tiles.tile_k or out_dim % cta_n:
        raise ValueError(
            f"gemm_gpu: T={num_tokens}, in={in_dim}, out={out_dim} do not fit tiles {tiles}: T must be a multiple of "
            f"{tiles.tile_m}, in of {tiles.tile_k} and out of {cta_n}; pad the batch, or use XLA's dot for this module"
        )


@functools.partial(jax.jit, static_argnames=("tiles", "k_splits"))
def gemm_gpu_rows(
    x: jax.Array,  # [T, in] bf16
    w_rows: jax.Array,  # [L * in, out] bf16: a layer stack of W flattened (L = 1 for one W)
    w_row: jax.Array,  # [1] i32: the first row of the layer's W in w_rows
    num_rows: jax.Array,  # [1] i32: the rows of x to compute (the rest are padding)
    *,
    tiles: GemmLoraTiles,
    k_splits: int = 1,
) -> jax.Array:
    """x @ W in one kernel ([T, out], x's dtype; with k_splits > 1 the kernel's float32 parts summed by XLA); its
    rows from num_rows[0] on are not computed (any values: `zero_rows_from`). The shapes as `check_gemm_shapes`
    requires, in / tile_k a multiple of k_splits."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_tokens, out_dim = x.shape[0], w_rows.shape[1]
    num_sms = jax.devices()[0].core_count
    out_dtype = x.dtype if k_splits == 1 else jnp.float32
    y = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, has_lora=False, k_splits=k_splits),
        out_type=jax.ShapeDtypeStruct((k_splits * num_tokens, out_dim), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(w_row, num_rows, x, w_rows)
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
    reference: bool = False,
) -> jax.Array:
    """y = x @ W (layer `layer` of a stack, read in place) in x's dtype, accumulated in float32.

    num_rows ([1] i32): the rows of x that are real (a token bucket's padding follows them); the kernel skips the
    row tiles after them and y is zero from row num_rows[0] on. None: every row. k_splits: parts of the K loop
    (None: `choose_k_splits` for this GPU's SMs with the default tiles; 1 when `tiles` are given or off GPUs).
    reference: compute it with the pure-JAX `x @ w[layer]` instead of the kernel, on platforms without Mosaic GPU
    (CPU tests of the code around the kernel); the shapes are checked either way."""
    in_dim, out_dim = w.shape[-2:]
    if k_splits is None:
        k_splits = 1 if tiles is not None or reference else default_k_splits(x.shape[0], in_dim, out_dim)
    tiles = tiles or choose_gemm_tiles(k_splits)
    if x.shape[1] != in_dim or x.dtype != w.dtype:
        raise ValueError(f"gemm_gpu: x {x.shape} {x.dtype} does not match W {w.shape} {w.dtype}")
    check_gemm_shapes(x.shape[0], in_dim, out_dim, tiles)
    if (in_dim // tiles.tile_k) % k_splits:
        raise ValueError(
            f"gemm_gpu: {in_dim // tiles.tile_k} K steps do not split into {k_splits} equal parts; pass a k_splits "
            "that divides them, or None for choose_k_splits"
        )
    if reference:
        w_layer = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        return zero_rows_from(jnp.dot(x, w_layer, preferred_element_type=jnp.float32).astype(x.dtype), num_rows)
    w_row = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer * in_dim, (1,)).astype(jnp.int32)
    rows = rows_operand(num_rows, x.shape[0])
    return zero_rows_from(
        gemm_gpu_rows(x, w.reshape(-1, out_dim), w_row, rows, tiles=tiles, k_splits=k_splits), num_rows
    )
