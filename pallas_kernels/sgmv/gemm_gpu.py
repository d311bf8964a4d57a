"""Base GEMM without LoRA for prefill on Hopper GPUs (Pallas on Mosaic GPU): y = x @ W[layer].

Where it sits: the decoder layers' linears (layers/base_gemm.py, called from `Linear.base`) in prefill buckets from
`--gpu-gemm-min-tokens` tokens, in place of XLA's `jnp.dot` on the layer's slice of the [L, in, out] weight stack.
This kernel reads the layer's rows of the stack in place; given the slice, XLA may hand its GEMM library a copy of
the layer's W first (a device-to-device copy per layer and module).

The kernel is `_kernel` of gemm_lora_gpu.py with `has_lora=False`: the same persistent grid over the SMs, the same
two consumer warpgroups side by side along N, the same `stages`-deep TMA pipeline of x and W tiles and the same TMA
epilogue, with no s or B tiles in shared memory, no entry tables among its operands and no LoRA loop after the K
loop. Its only scalar operand is the first row of the layer's W in the flattened [L * in, out] stack.

What exists here: `choose_gemm_tiles` (the deepest pipeline that fits shared memory without the LoRA tiles),
`check_gemm_shapes`, `gemm_gpu_rows` (the kernel call) and `gemm_gpu` (checks, tiles, and the pure-JAX reference
for platforms without Mosaic GPU). Needs: T a multiple of tile_m, in a multiple of tile_k, out a multiple of
2 * tile_n, bf16 operands (a bf16 WGMMA) of one dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sgmv.gemm_lora_gpu import GemmLoraTiles, _kernel, choose_gemm_lora_tiles


def is_hopper(device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.x (WGMMA and TMA: the Mosaic GPU GEMM kernels)."""
    return device.platform in ("gpu", "cuda") and str(getattr(device, "compute_capability", "0")).startswith("9")


def choose_gemm_tiles() -> GemmLoraTiles:
    """The tiles of the LoRA kernel's choice with no LoRA tiles in shared memory (rank 0): 4 stages and 64-column
    epilogue stores."""
    return choose_gemm_lora_tiles(0)


def check_gemm_shapes(num_tokens: int, in_dim: int, out_dim: int, tiles: GemmLoraTiles) -> None:
    """Raises ValueError, naming the fix, when the shapes do not fit the kernel's tiles."""
    cta_n = 2 * tiles.tile_n
    if num_tokens % tiles.tile_m or in_dim % tiles.tile_k or out_dim % cta_n:
        raise ValueError(
            f"gemm_gpu: T={num_tokens}, in={in_dim}, out={out_dim} do not fit tiles {tiles}: T must be a multiple of "
            f"{tiles.tile_m}, in of {tiles.tile_k} and out of {cta_n}; pad the batch, or use XLA's dot for this module"
        )


@functools.partial(jax.jit, static_argnames=("tiles",))
def gemm_gpu_rows(
    x: jax.Array,  # [T, in] bf16
    w_rows: jax.Array,  # [L * in, out] bf16: a layer stack of W flattened (L = 1 for one W)
    w_row: jax.Array,  # [1] i32: the first row of the layer's W in w_rows
    *,
    tiles: GemmLoraTiles,
) -> jax.Array:
    """x @ W in one kernel ([T, out], x's dtype); the shapes as `check_gemm_shapes` requires."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_sms = jax.devices()[0].core_count
    return plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, has_lora=False),
        out_type=jax.ShapeDtypeStruct((x.shape[0], w_rows.shape[1]), x.dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(w_row, x, w_rows)


def gemm_gpu(
    x: jax.Array,  # [T, in]
    w: jax.Array,  # [in, out], or the [L, in, out] stack with `layer`
    layer: jax.Array | None = None,
    *,
    tiles: GemmLoraTiles | None = None,
    reference: bool = False,
) -> jax.Array:
    """y = x @ W (layer `layer` of a stack, read in place) in x's dtype, accumulated in float32.

    reference: compute it with the pure-JAX `x @ w[layer]` instead of the kernel, on platforms without Mosaic GPU
    (CPU tests of the code around the kernel); the shapes are checked either way."""
    tiles = tiles or choose_gemm_tiles()
    in_dim, out_dim = w.shape[-2:]
    if x.shape[1] != in_dim or x.dtype != w.dtype:
        raise ValueError(f"gemm_gpu: x {x.shape} {x.dtype} does not match W {w.shape} {w.dtype}")
    check_gemm_shapes(x.shape[0], in_dim, out_dim, tiles)
    if reference:
        w_layer = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        return jnp.dot(x, w_layer, preferred_element_type=jnp.float32).astype(x.dtype)
    w_row = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer * in_dim, (1,)).astype(jnp.int32)
    return gemm_gpu_rows(x, w.reshape(-1, out_dim), w_row, tiles=tiles)
