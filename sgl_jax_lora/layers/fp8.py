"""8-bit float linears (`--quantization fp8`): weights and activations in float8_e4m3fn, scaled per matrix and token.

Where it sits: between `Linear.base` (layers/linear.py) and pallas_kernels/sgmv/gemm_fp8_gpu.py. The weight loader
(models/weight_loader.py) quantizes each decoder layer's linear weights once at startup (`quantize_weight`: one
scale per layer and module, W stored K-major [out, in]); every step quantizes each linear's input
(`quantize_activation`: one scale per token, from the largest magnitude of its row) and `fp8_product` computes
(xq @ Wq.T) * x_scale[:, None] * w_scale in the input's dtype. This is vLLM's online fp8 scheme for checkpoints of
16-bit weights (per-tensor weight scales, dynamic activation scales) with per-token activation scales: a row's 8-bit
input depends on that row alone, so one tenant's large activations never coarsen the quantization of the other rows
of its step, as one scale for the whole step would. On the kernel path the kernel reads the row scales and the
stack's W scales in place and applies both in its epilogue. The embeddings, norms, attention, KV cache and LM head
keep the model's dtype; LoRA adapters stay 16-bit and add their delta beside the 8-bit product.

Paths: on Hopper GPUs the Mosaic GPU kernel reads the layer's rows of the K-major stack in place, in every token
bucket; elsewhere (CPU, TPU, other GPUs) its pure-JAX reference, XLA's dot of the same 8-bit operands on the layer's
slice. With tensor parallelism either runs under `jax.shard_map` on each device's shard of W: column-parallel
modules quantize x replicated, row-parallel ones each quantize their own columns of x (a token's scale differs by
device, each applied before the all-reduce of the partial products). Layers whose shards do not fit the kernel's
tiles (in a multiple of 128, out of 256: small models) take XLA's dot under GSPMD.

What exists here: FP8_DTYPE, FP8_MAX, `quantize_weight`, `quantize_activation`, `Fp8Gemm` and `make_fp8_gemm` (the
model's static setting), `fp8_product`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.sgmv.gemm_fp8_gpu import check_fp8_shapes, gemm_fp8_gpu
from pallas_kernels.sgmv.gemm_gpu import is_hopper
from pallas_kernels.sgmv.gemm_lora_gpu import rows_operand
from sgl_jax_lora.layers.layer_stack import LayerStack, as_layer_array, layer_shape
from sgl_jax_lora.layers.sharding import logical_to_sharding

if TYPE_CHECKING:  # type only: layers/linear.py imports this module
    from sgl_jax_lora.layers.linear import LinearAxes

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_MIN_SCALE = 1e-12  # the scale of an all-zero tensor (its values quantize to zeros either way)


def _scale_of(amax: jax.Array) -> jax.Array:
    return jnp.maximum(amax.astype(jnp.float32) / FP8_MAX, _MIN_SCALE)


def _saturate(values: jax.Array, scale: jax.Array) -> jax.Array:
    """values / scale in float32, clipped to e4m3's finite range (it has no infinity), as 8-bit floats."""
    return jnp.clip(values.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., in, out] -> (q [..., out, in] float8_e4m3fn, K-major; scale [...] f32): one scale per matrix, its
    largest magnitude mapped to FP8_MAX, so that q * scale approximates w.T."""
    scale = _scale_of(jnp.max(jnp.abs(w), axis=(-2, -1)))
    return _saturate(jnp.swapaxes(w, -1, -2), scale[..., None, None]), scale


def quantize_activation(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, in] -> (xq [T, in] float8_e4m3fn, scale [T] f32), one scale per row (token): its largest magnitude
    mapped to FP8_MAX, so that xq * scale[:, None] approximates x."""
    scale = _scale_of(jnp.max(jnp.abs(x), axis=-1))
    return _saturate(x, scale[:, None]), scale


@dataclasses.dataclass(frozen=True)
class Fp8Gemm:
    """The model's static fp8 setting (a static attribute of the model and of every decoder-layer linear)."""

    mesh: Mesh | None = None  # the ("data", "tensor") mesh the weights are placed on; None: one device
    reference: bool = True  # the kernel's pure-JAX reference (XLA's dot on the layer's slice) instead of the kernel


def make_fp8_gemm(mesh: Mesh | None) -> Fp8Gemm:
    """The Mosaic GPU kernel on Hopper GPUs, its reference elsewhere."""
    return Fp8Gemm(mesh, reference=not is_hopper(mesh.devices.flat[0] if mesh is not None else jax.devices()[0]))


def fp8_product(
    x: jax.Array,
    kernel: jax.Array | LayerStack,
    scale: jax.Array | LayerStack,
    config: Fp8Gemm,
    axes: LinearAxes,
    num_rows: jax.Array | None = None,
    zero_padding: bool = True,
) -> jax.Array:
    """x [T, in] @ the layer's 8-bit W ([out, in], or a LayerStack of the [L, out, in] stack) times the layer's W
    scale ([1], or a LayerStack of the [L, 1] scales, which the kernel reads in place), x quantized on the way in (a
    scale per token); [T, out] in x's dtype, all-reduced for row-parallel modules. Layers whose shards do not fit
    the kernel's tiles (small models) take XLA's dot on the layer's slice under GSPMD. num_rows
    ([1] i32): the step's real tokens (the kernel skips the row tiles of the padding after them, zero in its output;
    None: every row). zero_padding=False: the kernel's padding rows may hold any values instead (no select zeroes
    them; for a consumer that masks them, gemm_fp8_gpu.py `gemm_fp8_gpu`)."""
    if not _fits_kernel(kernel, config, axes):
        w_scale = as_layer_array(scale)
        xq, x_scale = quantize_activation(x)  # a split x's row magnitudes are reduced over its devices
        y = jax.lax.dot_general(
            xq, as_layer_array(kernel), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return (y * (x_scale * w_scale)[:, None]).astype(x.dtype)
    stack, layer = (kernel.stack, kernel.layer) if isinstance(kernel, LayerStack) else (kernel[None], jnp.int32(0))
    w_scales = jnp.reshape(scale.stack if isinstance(scale, LayerStack) else scale, (-1,))  # [L]: the kernel reads one
    w_spec = _stack_spec(config.mesh, axes, stack.shape)
    out_axis, in_axis = w_spec[1], w_spec[2]

    rows = rows_operand(num_rows, x.shape[0])

    def local(x, stack, layer, w_scales, rows):
        xq, x_scale = quantize_activation(x)
        y = gemm_fp8_gpu(
            xq,
            stack,
            x_scale,
            layer,
            rows,
            w_scales=w_scales,
            out_dtype=x.dtype,
            reference=config.reference,
            zero_padding=zero_padding,
        )
        return jax.lax.psum(y, in_axis) if in_axis else y

    if config.mesh is None or config.mesh.size == 1:
        return local(x, stack, layer, w_scales, rows)
    in_specs = (P(None, in_axis), w_spec, P(), P(), P())
    sharded = jax.shard_map(local, mesh=config.mesh, in_specs=in_specs, out_specs=P(None, out_axis), check_vma=False)
    return sharded(x, stack, layer, w_scales, rows)


def _stack_spec(mesh: Mesh | None, axes: LinearAxes, shape: tuple[int, ...]) -> P:
    """Where the weight loader placed the [L, out, in] stack (the layer axis is never split)."""
    if mesh is None or mesh.size == 1:
        return P(None, None, None)
    return logical_to_sharding(mesh, ("layers", axes.out_axis, axes.in_axis), shape).spec


def _fits_kernel(kernel: jax.Array | LayerStack, config: Fp8Gemm, axes: LinearAxes) -> bool:
    """Whether each device's shard of W fits the kernel's tiles (small models' layers may not: XLA's dot then)."""
    out_dim, in_dim = layer_shape(kernel)
    spec = _stack_spec(config.mesh, axes, (1, out_dim, in_dim))
    try:
        check_fp8_shapes(
            in_dim // (config.mesh.shape[spec[2]] if spec[2] else 1),
            out_dim // (config.mesh.shape[spec[1]] if spec[1] else 1),
        )
    except ValueError:
        return False
    return True
