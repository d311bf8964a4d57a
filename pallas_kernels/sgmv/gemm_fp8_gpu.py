"""Base GEMM of 8-bit float operands on Hopper GPUs (Pallas on Mosaic GPU): y = (xq @ Wq[layer].T) * row scales * W's.

Where it sits: the decoder layers' linears of a model served with `--quantization fp8` (layers/fp8.py
`fp8_product`), on one Hopper GPU or under tensor parallelism, in every token bucket. x arrives quantized to
float8_e4m3fn with one scale per row (token), `scale` [T]; each layer's W is float8_e4m3fn with one scale of its own,
read by the kernel from the stack's `w_scales` [L]. W is stored K-major, [L, out, in] (an 8-bit WGMMA reads both
operands K-major), and read in place at the layer's rows, so no layer's weight is copied.

The kernel is `_kernel` of gemm_lora_gpu.py with `fp8=True`: the same persistent grid over the SMs, two consumer
warpgroups side by side along N, a `stages`-deep TMA pipeline (K tiles of 128 bytes: 128 columns of 8-bit x and W
rows), the float32 accumulator's rows scaled once in the epilogue by their scales times the layer's W scale (the row
tile's scales fetched into shared memory while the K loop runs; no XLA op combines the scales) and stored in the
output dtype, and split K at decode sizes (`choose_k_splits`: each part scaled, then summed by XLA). At the same
tiles an 8-bit WGMMA does twice a 16-bit one's work per cycle and each tile's bytes halve, so prefill-sized products
run up to twice as fast and decode-sized ones read half the weight bytes.

What exists here: `choose_fp8_tiles`, `check_fp8_shapes`, `fp8_kernel_call` (the kernel on a grid), `gemm_fp8_gpu_rows`
(the call on this GPU's SMs) and `gemm_fp8_gpu` (padding of T to the
row tile, checks, and the pure-JAX reference for platforms without Mosaic GPU). Needs: in a multiple of tile_k,
out a multiple of 2 * tile_n.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sgmv.gemm_lora_gpu import (
    GemmLoraTiles,
    _kernel,
    choose_k_splits,
    persistent_kernel,
    rows_operand,
    zero_rows_from,
)

FP8_TILE_K = 128  # columns of a K tile: 128 bytes of 8-bit values, the widest swizzle


def choose_fp8_tiles(k_splits: int = 1) -> GemmLoraTiles:
    """4 stages of 128 x 128 x tiles and 128 x 256 W tiles (48 KiB each), 64-column bf16 epilogue stores; with split
    K, 32-column stores of the float32 parts (the same shared memory)."""
    tiles = GemmLoraTiles(tile_k=FP8_TILE_K, stages=4, epilogue_n=64 if k_splits == 1 else 32)
    assert tiles.smem_bytes(0, out_itemsize=2 if k_splits == 1 else 4, in_itemsize=1) <= 226 * 1024
    return tiles


def check_fp8_shapes(in_dim: int, out_dim: int) -> None:
    """Raises ValueError, naming the fix, when a W of these sizes does not fit the kernel's tiles."""
    tiles = choose_fp8_tiles()
    if in_dim % tiles.tile_k or out_dim % (2 * tiles.tile_n):
        raise ValueError(
            f"gemm_fp8_gpu: in={in_dim}, out={out_dim} do not fit tiles {tiles}: in must be a multiple of "
            f"{tiles.tile_k} and out of {2 * tiles.tile_n}; serve this model without --quantization fp8"
        )


def default_fp8_k_splits(num_tokens: int, in_dim: int, out_dim: int) -> int:
    """The parts the K loop is cut into when not told: `choose_k_splits` over this GPU's SMs; 1 off GPUs."""
    num_sms = getattr(jax.devices()[0], "core_count", 0)
    return choose_k_splits(num_tokens, in_dim, out_dim, choose_fp8_tiles(), num_sms) if num_sms else 1


@functools.partial(jax.jit, static_argnames=("out_dim", "tiles", "k_splits", "out_dtype"))
def gemm_fp8_gpu_rows(
    xq: jax.Array,  # [T, in] float8_e4m3fn, T a multiple of tile_m
    w_rows: jax.Array,  # [L * out, in] float8_e4m3fn: a K-major layer stack flattened (L = 1 for one W)
    w_row: jax.Array,  # [1] i32: the first row of the layer's W in w_rows
    w_scales: jax.Array,  # [L] f32: each layer's W scale (the kernel reads the layer's, at w_row // out_dim; [1]: W's)
    scale: jax.Array,  # [T] f32: each row's scale (x's)
    num_rows: jax.Array,  # [1] i32: the rows of xq to compute (the rest are padding)
    *,
    out_dim: int,
    tiles: GemmLoraTiles,
    k_splits: int,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """(xq @ W.T) * scale[:, None] * w_scales[layer] in one kernel ([T, out] in out_dtype; with k_splits > 1 the scaled
    float32 parts summed by XLA); its rows from num_rows[0] on are not computed (any values: `zero_rows_from`)."""
    num_tokens = xq.shape[0]
    y = fp8_kernel_call(
        xq,
        w_rows,
        w_row,
        w_scales,
        scale,
        num_rows,
        out_dim=out_dim,
        tiles=tiles,
        k_splits=k_splits,
        out_dtype=out_dtype,
        num_sms=jax.devices()[0].core_count,
    )
    if k_splits == 1:
        return y
    return y.reshape(k_splits, num_tokens, out_dim).sum(axis=0).astype(out_dtype)


def fp8_kernel_call(
    xq: jax.Array,
    w_rows: jax.Array,
    w_row: jax.Array,
    w_scales: jax.Array,
    scale: jax.Array,
    num_rows: jax.Array,
    *,
    out_dim: int,
    tiles: GemmLoraTiles,
    k_splits: int,
    out_dtype: jnp.dtype,
    num_sms: int,
    interpret=None,
) -> jax.Array:
    """`gemm_fp8_gpu_rows`' kernel on a grid of `num_sms` CTAs, its own output: [k_splits * T, out] (float32 parts
    with k_splits > 1). interpret: Mosaic GPU interpreter params (CPU tests)."""
    return persistent_kernel(
        functools.partial(_kernel, tiles=tiles, has_lora=False, k_splits=k_splits, fp8=True),
        jax.ShapeDtypeStruct((k_splits * xq.shape[0], out_dim), out_dtype if k_splits == 1 else jnp.float32),
        num_sms,
        interpret=interpret,
    )(w_row, num_rows, w_scales, scale, xq, w_rows)


def gemm_fp8_gpu(
    xq: jax.Array,  # [T, in] float8_e4m3fn
    w: jax.Array,  # [out, in] float8_e4m3fn, or the [L, out, in] stack with `layer`
    scale: jax.Array,  # f32 [T], each row's scale (or a scalar for every row)
    layer: jax.Array | None = None,
    num_rows: jax.Array | None = None,
    *,
    w_scales: jax.Array | None = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
    k_splits: int | None = None,
    reference: bool = False,
    zero_padding: bool = True,
) -> jax.Array:
    """y = (xq @ W.T) * scale[:, None] * w_scales[layer] in out_dtype, accumulated in float32, W read in place from its
    stack. w_scales: [L] f32, each layer's W scale ([1]: W's for any layer; None: 1). T is padded to the kernel's row
    tile with zero rows (their products are dropped). num_rows ([1] i32): the rows of xq that are
    real; the kernel skips the row tiles after them and y is zero from row num_rows[0] on (None: every row).
    zero_padding: False leaves out the select that zeroes those rows (`zero_rows_from`): they then hold any values
    (the kernel leaves them unwritten; NaN possible), for a consumer that masks them itself. reference: the same
    with XLA's dot on the layer's slice (platforms without Mosaic GPU); the shapes are checked either way. The
    reference computes every row: with zero_padding=False it returns the padding rows' products."""
    out_dim, in_dim = w.shape[-2:]
    if xq.shape[1] != in_dim or xq.dtype != w.dtype or w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"gemm_fp8_gpu: x {xq.shape} {xq.dtype} does not match W {w.shape} {w.dtype} (float8_e4m3fn)")
    check_fp8_shapes(in_dim, out_dim)
    num_tokens = xq.shape[0]
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape not in ((), (1,), (num_tokens,)):
        raise ValueError(f"gemm_fp8_gpu: scale {scale.shape} is neither one per row of x ({num_tokens}) nor a scalar")
    scale = jnp.broadcast_to(jnp.reshape(scale, (-1,)), (num_tokens,))
    num_layers = 1 if w.ndim == 2 else w.shape[0]
    w_scales = jnp.ones((1,), jnp.float32) if w_scales is None else jnp.asarray(w_scales, jnp.float32)
    if w_scales.shape not in ((1,), (num_layers,)):
        raise ValueError(
            f"gemm_fp8_gpu: w_scales {w_scales.shape} is neither one scale per layer of W ({num_layers}) nor one"
        )
    if reference:
        w_layer = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        w_scale = w_scales[0] if layer is None or w_scales.shape[0] == 1 else w_scales[layer]
        y = jax.lax.dot_general(xq, w_layer, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        y = (y * (scale * w_scale)[:, None]).astype(out_dtype)
        return zero_rows_from(y, num_rows) if zero_padding else y
    tile_m = choose_fp8_tiles().tile_m
    padded = -(-num_tokens // tile_m) * tile_m
    if padded != num_tokens:
        xq = jnp.pad(xq, ((0, padded - num_tokens), (0, 0)))
        scale = jnp.pad(scale, (0, padded - num_tokens))
    if k_splits is None:
        k_splits = default_fp8_k_splits(padded, in_dim, out_dim)
    tiles = choose_fp8_tiles(k_splits)
    if (in_dim // tiles.tile_k) % k_splits:
        raise ValueError(f"gemm_fp8_gpu: {in_dim // tiles.tile_k} K steps do not split into {k_splits} equal parts")
    w_row = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer * out_dim, (1,)).astype(jnp.int32)
    y = gemm_fp8_gpu_rows(
        xq,
        w.reshape(-1, in_dim),
        w_row,
        w_scales,
        scale,
        rows_operand(num_rows, num_tokens),
        out_dim=out_dim,
        tiles=tiles,
        k_splits=k_splits,
        out_dtype=jnp.dtype(out_dtype),
    )
    return zero_rows_from(y[:num_tokens], num_rows) if zero_padding else y[:num_tokens]
