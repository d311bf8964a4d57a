"""Skinny base GEMM for decode buckets on Hopper GPUs (Pallas on Mosaic GPU): y = x @ W[layer] with the tokens
as the WGMMA's N side.

Where it sits: beside gemm_gpu.py, for the decoder layers' linears in small token buckets (layers/base_gemm.py). The
kernel of gemm_lora_gpu.py puts the tokens on the WGMMA's M side in row tiles of 128, so a decode step of 147 rows in
the 256 bucket computes 256 rows, and a bucket under 128 tokens does not fit it at all. Here each CTA tile is 128
of W's output columns (64 a consumer warpgroup: one WGMMA's M) by the step's tokens: the kernel computes
y^T [out, T] = W^T @ x^T, reading W's [tile_k, 128] blocks and x's [width, tile_k] blocks through a TMA pipeline
and handing both to the WGMMA transposed. The epilogue writes y itself: each [64, 32] piece of the accumulator is
cast to the WGMMA's transposed register layout and stored into a transposed view of a [32 tokens, 64 columns]
shared-memory slot, which TMA copies to y's rows. The token width is chosen in the kernel from the step's real row
count: the smallest multiple of `n_step` that holds them, each width a branch with its own pipeline and accumulator
([64, width] float32 a warpgroup), so 147 rows compute 160 columns, not 256, and each W block read from memory
serves every real row at once.

Split K: with few CTA tiles (Llama-3-8B's o and down: 32 tiles of 128 columns) the K loop is cut into parts
(`choose_skinny_splits`), each writing its float32 product to its rows of a [k_splits * T, out] buffer; XLA sums the
parts, fused into y's consumer where it can (the residual add).

What exists here: `SkinnyTiles`, `choose_skinny_splits`, `check_skinny_shapes`, `skinny_kernel_call` (the kernel on
a persistent grid; the Mosaic GPU interpreter does not take its transposed shared-memory operands, so it runs on
Hopper GPUs only) and `gemm_skinny_gpu` (checks, splits, the sum of the parts, and the pure-JAX
reference for platforms without Mosaic GPU). Needs: T a multiple of n_step, in a multiple of tile_k (times
k_splits), out a multiple of 128, bf16 operands of one dtype. The rows of y past the chosen width, and those after
num_rows[0], hold any values unless zeroed (`zero_rows_from`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sgmv.gemm_lora_gpu import (
    SMEM_BYTES,
    SMEM_SPARE,
    persistent_kernel,
    rows_operand,
    smem_transforms,
    zero_rows_from,
)

TILE_OUT = 128  # W's output columns a CTA tile computes: 64 a consumer warpgroup (a WGMMA's M)
WG_OUT = TILE_OUT // 2
EPILOGUE_N = 32  # tokens a TMA epilogue store holds (its rows; its columns: a warpgroup's 64 output columns)
MAX_SKINNY_TOKENS = 256  # a warpgroup's [64, T] float32 accumulator: 128 registers a thread at 256 tokens


@dataclasses.dataclass(frozen=True)
class SkinnyTiles:
    n_step: int = 32  # the token widths the kernel may run: multiples of this up to the bucket
    tile_k: int = 64
    stages: int = 4  # TMA pipeline depth of W and x blocks, at most: fewer where the widest x block needs it
    k_splits: int = 1  # parts of the K loop (float32 parts summed by XLA)

    def stages_for(self, width: int, out_itemsize: int) -> int:
        """The deepest pipeline of at most `stages` whose W and x blocks at this token width fit shared memory
        beside the epilogue's two slots a warpgroup."""
        epilogue = 2 * 2 * WG_OUT * EPILOGUE_N * out_itemsize
        per_stage = (self.tile_k * TILE_OUT + width * self.tile_k) * 2
        for stages in range(self.stages, 1, -1):
            if stages * per_stage + epilogue + SMEM_SPARE <= SMEM_BYTES:
                return stages
        raise ValueError(f"gemm_skinny_gpu: a token width of {width} does not fit shared memory; use gemm_gpu")


def choose_skinny_splits(in_dim: int, out_dim: int, num_sms: int, tile_k: int = 64) -> int:
    """The most K parts (1, 2, 4 or 8) whose CTA tiles x parts still fit one wave over the SMs, each part at least 8
    K steps; 1 where the tiles alone fill a wave."""
    tiles, k_steps = out_dim // TILE_OUT, in_dim // tile_k
    splits = 1
    for candidate in (2, 4, 8):
        if tiles * candidate <= num_sms and k_steps % candidate == 0 and k_steps // candidate >= 8:
            splits = candidate
    return splits


def check_skinny_shapes(num_tokens: int, in_dim: int, out_dim: int, tiles: SkinnyTiles) -> None:
    """Raises ValueError, naming the fix, when the shapes do not fit the kernel."""
    if num_tokens > MAX_SKINNY_TOKENS or num_tokens % tiles.n_step:
        raise ValueError(
            f"gemm_skinny_gpu: T={num_tokens} must be a multiple of {tiles.n_step} up to {MAX_SKINNY_TOKENS} (a "
            "warpgroup holds [64, T] in registers); use gemm_gpu for larger buckets"
        )
    if out_dim % TILE_OUT or in_dim % (tiles.tile_k * tiles.k_splits):
        raise ValueError(
            f"gemm_skinny_gpu: in={in_dim}, out={out_dim} do not fit: out must be a multiple of {TILE_OUT} and in of "
            f"{tiles.tile_k} x {tiles.k_splits} K parts; use XLA's dot for this module"
        )


def _kernel(w_row_ref, num_rows_ref, x_ref, w_ref, out_ref, *, tiles: SkinnyTiles):
    """The kernel body: refs (w_row [1] i32, num_rows [1] i32, x [T, in], w [L * in, out], out [k_splits * T, out]).
    Every CTA loops over the units (K part, 128-column tile); the token width is one branch for the whole call."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (num_tokens, in_dim), k_splits, tk = x_ref.shape, tiles.k_splits, tiles.tile_k
    out_dim = out_ref.shape[1]
    out_tiles, k_len = out_dim // TILE_OUT, in_dim // k_splits
    widths = list(range(tiles.n_step, num_tokens + 1, tiles.n_step))
    width_index = jnp.clip((num_rows_ref[0] + tiles.n_step - 1) // tiles.n_step - 1, 0, len(widths) - 1)

    def transforms(minor: int, dtype=x_ref.dtype):
        return smem_transforms(minor, dtype)

    def pipeline(width, body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_len // tk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tk, TILE_OUT), lambda k: (k, 0), transforms=transforms(tk), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((width, tk), lambda k: (0, k), transforms=transforms(tk), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiles.stages_for(width, jnp.dtype(out_ref.dtype).itemsize),
            compute_context=compute_context,
        )

    unused = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies

    def run_width(width):
        views = (w_ref.at[pl.ds(0, k_len), pl.ds(0, TILE_OUT)], x_ref.at[pl.ds(0, width), pl.ds(0, k_len)])

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=pipeline(width, unused, unused).get_allocations(*views),
            out_smem=plgpu.SMEM(
                (2, 2, EPILOGUE_N, WG_OUT), out_ref.dtype, transforms=transforms(WG_OUT, out_ref.dtype)
            ),
            collective_axes="wg",
        )
        def scope(pipeline_allocs, out_smem):
            wg = jax.lax.axis_index("wg")

            @plgpu.nd_loop((k_splits * out_tiles,), collective_axes="sm")
            def unit_loop(loop_info):
                (linear,) = loop_info.index
                split, tile = linear // out_tiles, linear % out_tiles
                wg_out = out_ref.at[pl.ds(split * num_tokens, num_tokens), pl.ds(tile * TILE_OUT + wg * WG_OUT, WG_OUT)]

                def store(acc):
                    """This warpgroup's [64, width] of y^T as y's [width, 64], EPILOGUE_N tokens a store through
                    two smem slots, each piece transposed in registers on its way into the slot."""
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for piece in range(width // EPILOGUE_N):
                        slot = piece % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        y_t = acc[:, piece * EPILOGUE_N : (piece + 1) * EPILOGUE_N]
                        slot_t = out_smem.at[wg, slot].transpose((1, 0))
                        slot_t[...] = plgpu.layout_cast(y_t, plgpu.Layout.WGMMA_TRANSPOSED)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot], wg_out.at[pl.ds(piece * EPILOGUE_N, EPILOGUE_N), :]
                        )

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_OUT, width), jnp.float32))
                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        store(acc_ref[...].astype(out_ref.dtype))

                def mma(_, w_smem, x_smem, acc_ref):
                    w_cols = w_smem.at[:, pl.ds(wg * WG_OUT, WG_OUT)].transpose((1, 0))  # [64, tk]
                    plgpu.wgmma(acc_ref, w_cols, x_smem.transpose((1, 0)))  # @ [tk, width]
                    plgpu.wgmma_wait(0)
                    return acc_ref

                w_rows = pl.ds(pl.multiple_of(w_row_ref[0] + split * k_len, tk), k_len)
                x_cols = pl.ds(split * k_len, k_len)
                pipeline(width, mma, compute_context)(
                    w_ref.at[w_rows, pl.ds(tile * TILE_OUT, TILE_OUT)],
                    x_ref.at[pl.ds(0, width), x_cols],
                    allocations=pipeline_allocs,
                )

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if len(widths) == 1:
        run_width(widths[0])
        return
    for index, width in enumerate(widths):
        pl.when(width_index == index)(functools.partial(run_width, width))


def skinny_kernel_call(
    x: jax.Array,
    w_rows: jax.Array,
    w_row: jax.Array,
    num_rows: jax.Array,
    *,
    tiles: SkinnyTiles,
    num_sms: int,
    interpret=None,
) -> jax.Array:
    """The kernel on a grid of `num_sms` CTAs: y [k_splits * T, out] (float32 parts with k_splits > 1, part p in
    rows p * T to (p + 1) * T), each part's rows past the chosen width unwritten. w_rows: a layer stack of W flattened
    [L * in, out]; w_row: [1] i32, the layer's first row in it; num_rows: [1] i32, the step's real tokens.
    interpret: Mosaic GPU interpreter params, for a JAX whose interpreter takes transposed shared-memory operands
    (0.10's does not)."""
    out_dtype = x.dtype if tiles.k_splits == 1 else jnp.float32
    out_type = jax.ShapeDtypeStruct((tiles.k_splits * x.shape[0], w_rows.shape[1]), out_dtype)
    body = functools.partial(_kernel, tiles=tiles)
    return persistent_kernel(body, out_type, num_sms, interpret)(w_row, num_rows, x, w_rows)


@functools.partial(jax.jit, static_argnames=("tiles",))
def _skinny_rows(x, w_rows, w_row, num_rows, *, tiles: SkinnyTiles) -> jax.Array:
    num_sms = jax.devices()[0].core_count
    y = skinny_kernel_call(x, w_rows, w_row, num_rows, tiles=tiles, num_sms=num_sms)
    if tiles.k_splits > 1:
        y = y.reshape(tiles.k_splits, x.shape[0], -1).sum(axis=0)
    return y.astype(x.dtype)


def gemm_skinny_gpu(
    x: jax.Array,  # [T, in]
    w: jax.Array,  # [in, out], or the [L, in, out] stack with `layer`
    layer: jax.Array | None = None,
    num_rows: jax.Array | None = None,
    *,
    n_step: int = 32,
    k_splits: int | None = None,
    reference: bool = False,
    zero_padding: bool = True,
) -> jax.Array:
    """y = x @ W (layer `layer` of a stack, read in place) in x's dtype, accumulated in float32, for T up to
    MAX_SKINNY_TOKENS. num_rows ([1] i32): the real rows (the kernel computes the smallest multiple of n_step that
    holds them); y is zero from row num_rows[0] on, or, with zero_padding=False, any values there. k_splits: K parts
    (None: `choose_skinny_splits` on this GPU). reference: the pure-JAX product instead of the kernel (CPU)."""
    in_dim, out_dim = w.shape[-2:]
    if k_splits is None:
        num_sms = getattr(jax.devices()[0], "core_count", 0)
        k_splits = choose_skinny_splits(in_dim, out_dim, num_sms) if num_sms and not reference else 1
    tiles = SkinnyTiles(n_step=n_step, k_splits=k_splits)
    if x.shape[1] != in_dim or x.dtype != w.dtype:
        raise ValueError(f"gemm_skinny_gpu: x {x.shape} {x.dtype} does not match W {w.shape} {w.dtype}")
    check_skinny_shapes(x.shape[0], in_dim, out_dim, tiles)
    if reference:
        w_layer = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        y = jnp.dot(x, w_layer, preferred_element_type=jnp.float32).astype(x.dtype)
    else:
        w_row = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer * in_dim, (1,)).astype(jnp.int32)
        rows = rows_operand(num_rows, x.shape[0])
        y = _skinny_rows(x, w.reshape(-1, out_dim), w_row, rows, tiles=tiles)
    return zero_rows_from(y, num_rows) if zero_padding else y
