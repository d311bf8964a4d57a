"""Linear layers with shard-major packed outputs.

A packed linear (qkv_proj <- q, k, v; gate_up_proj <- gate, up) stores its output features shard-major:
for tensor-parallel size tp, the output is [tp, part0_local | part1_local | ...], so that splitting the
output on the "tensor" mesh axis hands every device whole local parts and `split_packed` needs no
communication. models/weight_loader.py writes HF weights into this layout.

Each linear declares the logical axes of its weights (LinearAxes, given by the model beside its layer
definitions); layers/sharding.py turns them into mesh shardings.

The base weight is a `BaseKernel` parameter. Inside the model's layer loop it arrives as the layer's [in, out]
slice, or, in prefill buckets that run the base GEMM kernel (`--gpu-gemm-min-tokens`, layers/base_gemm.py), as a
LayerStack view of the [L, in, out] stack (layers/layer_stack.py), which `base` hands to that kernel when the module
fits it and slices otherwise. With `--quantization fp8` (`fp8` given) the base weight is an `Fp8Kernel` instead,
8-bit [out, in] with an `Fp8Scale` per layer, both always handed over as LayerStack views, and `base` computes
layers/fp8.py `fp8_product`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.sgmv.gemm_lora_gpu import zero_rows_from
from sgl_jax_lora.layers.base_gemm import BaseGemm, base_gemm
from sgl_jax_lora.layers.fp8 import FP8_DTYPE, Fp8Gemm, fp8_product
from sgl_jax_lora.layers.layer_stack import LayerStack, as_layer_array


@dataclasses.dataclass(frozen=True)
class LinearAxes:
    """Logical axis names of a linear's weights (mapped to mesh axes by layers/sharding.py)."""

    in_axis: str  # kernel rows: the input features
    out_axis: str  # kernel columns and bias: the packed output features
    part_axes: tuple[str, ...]  # each packed part's own output features (the LoRA B buffers of that part)


class BaseKernel(nnx.Param):
    """A linear's base weight [in, out]: the model's layer loop can hand it over as a LayerStack view (see above)."""


class Fp8Kernel(nnx.Param):
    """A linear's 8-bit base weight [out, in] (K-major, float8_e4m3fn; --quantization fp8): the model's layer loop
    always hands it over as a LayerStack view of the [L, out, in] stack, which the fp8 kernel reads in place."""


class Fp8Scale(nnx.Param):
    """The float32 scale of an Fp8Kernel, [1] per layer: kernel * scale approximates the 16-bit weight, transposed."""


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). kernel [in, out]; `part_sizes` are the global widths of packed parts. base_gemm: the
    model's base-GEMM kernel setting (None: XLA's dot always). fp8: the model's fp8 setting (layers/fp8.py; None: the
    weight in `dtype`)."""

    def __init__(
        self,
        in_features: int,
        part_sizes: tuple[int, ...],
        tp_size: int,
        use_bias: bool,
        dtype: jnp.dtype,
        axes: LinearAxes,
        base_gemm: BaseGemm | None = None,
        fp8: Fp8Gemm | None = None,
    ):
        if len(axes.part_axes) != len(part_sizes):
            raise ValueError(f"{len(part_sizes)} packed parts but {len(axes.part_axes)} part axes in {axes}")
        self.in_features = in_features
        self.part_sizes = tuple(part_sizes)
        self.tp_size = tp_size
        self.axes = axes
        self.base_gemm = base_gemm
        self.fp8 = fp8
        out_features = sum(part_sizes)
        if fp8 is not None:
            self.kernel = Fp8Kernel(
                jnp.zeros((out_features, in_features), FP8_DTYPE), logical_axes=(axes.out_axis, axes.in_axis)
            )
            # [1], not a scalar: the layer stack's axis is added to a parameter's declared axes, and a scalar has none
            self.kernel_scale = Fp8Scale(jnp.ones((1,), jnp.float32), logical_axes=(None,))
        else:
            self.kernel = BaseKernel(
                jnp.zeros((in_features, out_features), dtype), logical_axes=(axes.in_axis, axes.out_axis)
            )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), logical_axes=(axes.out_axis,)) if use_bias else None

    def base(self, x: jax.Array, num_rows: jax.Array | None = None, zero_padding: bool = True) -> jax.Array:
        """x [T, in] -> [T, out] (packed layout): with fp8, layers/fp8.py's 8-bit product; else the base GEMM kernel
        on a LayerStack kernel in the buckets that run it, when the module fits it; else XLA's dot. num_rows ([1]
        i32): the step's real tokens; the GEMM kernels skip the padding's row tiles after them, whose outputs are
        then zero (XLA's dot computes them: padding rows' outputs are never read). None: every row is real.
        zero_padding=False: the GEMM kernels' padding rows may hold any values, NaN included (the select that
        zeroes them is left out), for a consumer that masks them itself (models/llama.py: q|k|v into the rotary +
        K/V write kernel); the bias is added either way."""
        kernel = self.kernel.get_value()
        if self.fp8 is not None:
            scale = self.kernel_scale.get_value()
            y = fp8_product(x, kernel, scale, self.fp8, self.axes, num_rows, zero_padding=zero_padding)
            return y if self.bias is None else y + self.bias[...]
        if self._runs_base_gemm(kernel, x):
            y = base_gemm(x, kernel, self.base_gemm, self.axes, num_rows, zero_padding=zero_padding)
            if y is not None:
                return y if self.bias is None else y + self.bias[...]
        return base_product(x, as_layer_array(kernel), self.bias)

    def _runs_base_gemm(self, kernel: object, x: jax.Array) -> bool:
        """Whether x's token bucket runs the base GEMM kernel on this 16-bit weight (a LayerStack view there)."""
        return isinstance(kernel, LayerStack) and self.base_gemm is not None and self.base_gemm.runs(x.shape[0])

    def _runs_gated_base_gemm(self, kernel: object, x: jax.Array) -> bool:
        """Whether the base GEMM kernel's gated epilogue may take this [gate | up] module (no bias, no 8-bit
        weight) in x's bucket; `base_gemm` then says whether its shapes fit."""
        return self.bias is None and self.fp8 is None and self._runs_base_gemm(kernel, x)

    def __call__(
        self,
        x: jax.Array,
        lora_batch: object = None,
        residual: jax.Array | None = None,
        num_rows: jax.Array | None = None,
        zero_padding: bool = True,
    ) -> jax.Array:
        """x [T, in] -> [T, out] (+ residual [T, out] when given); num_rows and zero_padding as in `base`."""
        y = self.base(x, num_rows, zero_padding)
        return y if residual is None else residual + y

    def silu_and_mul(self, x: jax.Array, lora_batch: object = None, num_rows: jax.Array | None = None) -> jax.Array:
        """A packed (gate, up) linear's activation silu(x @ W_gate) * (x @ W_up), [T, out / 2]. Where `base`
        would run the base GEMM kernel (no bias, no 8-bit weight), the kernel's epilogue applies it (gemm_gpu.py
        `gated`), so the [T, out] product never reaches device memory; else the product, split per part, then the
        activation. lora_batch: as in `__call__` (a LoRALinear applies its adapters: `LoRALinear.silu_and_mul`)."""
        kernel = self.kernel.get_value()
        if self._runs_gated_base_gemm(kernel, x):
            y = base_gemm(x, kernel, self.base_gemm, self.axes, num_rows, gated=True)
            if y is not None:
                return y
        return self.unfused_silu_and_mul(x, lora_batch, num_rows)

    def unfused_silu_and_mul(
        self, x: jax.Array, lora_batch: object = None, num_rows: jax.Array | None = None
    ) -> jax.Array:
        """`silu_and_mul` from the packed product `self(x, lora_batch)`. The padding rows the GEMM kernels leave
        unwritten are zeroed in the activation's elementwise pass (XLA fuses the select into it) rather than in a
        pass of their own over the [T, out] product, which XLA cannot fuse into the LoRA expand kernel that reads
        the product after the base GEMM kernel."""
        y = zero_rows_from(self(x, lora_batch, num_rows=num_rows, zero_padding=False), num_rows)
        gate, up = split_packed(y, self.part_sizes, self.tp_size)
        return jax.nn.silu(gate) * up


def base_product(x: jax.Array, kernel: jax.Array, bias: nnx.Param | None) -> jax.Array:
    """x [T, in] @ kernel [in, out] (+ bias), in x's dtype (GPU, TPU and CPU accumulate a bfloat16 product in
    float32). The product comes out in x's dtype, not float32 then cast: with the kernel split on `in` (tensor
    parallelism), the partial products are all-reduced in the product's dtype, so bfloat16 halves that traffic."""
    y = jnp.dot(x, kernel, preferred_element_type=x.dtype)
    return y if bias is None else y + bias[...]


def split_packed(y: jax.Array, part_sizes: tuple[int, ...], tp_size: int) -> list[jax.Array]:
    """[T, sum(part_sizes)] shard-major packed -> one [T, part_size] array per part."""
    num_tokens = y.shape[0]
    local_sizes = [p // tp_size for p in part_sizes]
    y = y.reshape(num_tokens, tp_size, sum(local_sizes))
    parts, start = [], 0
    for local in local_sizes:
        parts.append(y[:, :, start : start + local].reshape(num_tokens, local * tp_size))
        start += local
    return parts


def pack_parts(parts: list[jax.Array], tp_size: int) -> jax.Array:
    """Inverse of split_packed: per-part [T, part_size] -> [T, sum] shard-major packed."""
    num_tokens = parts[0].shape[0]
    local = [p.reshape(num_tokens, tp_size, p.shape[1] // tp_size) for p in parts]
    return jnp.concatenate(local, axis=2).reshape(num_tokens, -1)
