"""BaseGemm: the decoder layers' base GEMMs as one Mosaic GPU kernel in large token buckets (`--gpu-gemm-min-tokens`).

Where it sits: between `Linear.base` (layers/linear.py) and pallas_kernels/sgmv/gemm_gpu.py. In token buckets of at
least `min_tokens` tokens, LlamaForCausalLM (models/llama.py) keeps every decoder layer's base weight (`BaseKernel`)
as the whole [L, in, out] stack outside its layer scan and hands each layer LayerStack views (layers/layer_stack.py),
as the fused LoRA path does for LoRA modules; `Linear.base` then calls `base_gemm`, which runs the kernel on the
stack, reading the layer's W in place (XLA's dot on the layer's slice may copy that slice first). A module the
kernel cannot take (its tiles, or a dtype other than bfloat16) gets None and runs XLA's dot on the slice.

Tensor parallelism: Pallas calls do not take part in GSPMD propagation, so with several devices the kernel runs
under `jax.shard_map`, each device on its shard of W as the weight loader placed it (layers/sharding.py):
column-parallel modules (W split on `out`) take x replicated and give y split on its columns; row-parallel ones
(W split on `in`) take x split on its columns and all-reduce y over "tensor" in x's dtype, as XLA's dot does.

The skinny form (`BaseGemm.skinny`, on in the default setting of one Hopper GPU): in the kernel's buckets of at most
SKINNY_MAX_TOKENS tokens (the 256 bucket by default) every module runs pallas_kernels/sgmv/gemm_skinny_gpu.py
instead, the tokens on the WGMMA's N side, as many as the step's real rows need (147 rows compute 160, not the two
128-row tiles' 256); gate|up's activation (and its LoRA delta) follows it in XLA.
In that setting every forward keeps XLA's dots in those buckets instead (`BaseGemm.xla_dots`, XLA_DOTS_MAX_TOKENS),
which the engine compiles as cuBLAS GEMMs there (`keeps_xla_dots`, model_executor/compiler_options.py): the skinny
form runs only where XLA_DOTS_MAX_TOKENS is lowered below SKINNY_MAX_TOKENS (scripts/ab_step.py's `xla-dots` knob).

`make_base_gemm` turns the flag into the model's static setting: default DEFAULT_MIN_TOKENS on one Hopper GPU
(compute capability 9.x), off elsewhere and under tensor parallelism (not yet run on GPUs: set the flag to use it
there); a positive value off Hopper GPUs (CPU tests) computes with the kernel's pure-JAX reference
(`gemm_gpu(..., reference=True)`), so the plumbing around the kernel is tested on CPU. At decode sizes the kernel
splits its K loop over the SMs (gemm_gpu.py `choose_k_splits`), or cuts only its last partial wave of tiles in pieces of
K (`default_tail_split`, tail_split.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.sgmv.gemm_gpu import check_gemm_shapes, choose_gemm_tiles, gemm_gpu, is_hopper
from pallas_kernels.sgmv.gemm_lora_gpu import rows_operand, silu_and_mul, zero_rows_from
from pallas_kernels.sgmv.gemm_skinny_gpu import SkinnyTiles, check_skinny_shapes, gemm_skinny_gpu
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.sharding import logical_to_sharding

if TYPE_CHECKING:  # type only: layers/linear.py imports this module
    from sgl_jax_lora.layers.linear import LinearAxes

# the least token bucket that runs the kernel on Hopper GPUs by default, for every module: with the K loop split at
# decode sizes it is faster than XLA's GEMM from 256 tokens for q|k|v, gate|up and down; o alone is a little slower
# there, but XLA's dot on o's layer slices also copies o's whole weight stack once a forward, so the 256-token
# decode step is faster with o in the kernel too; 64-token buckets do not fit the kernel's 128-row tiles
# (docs/benchmarks.md "The base GEMM kernel in decode and prefill steps")
DEFAULT_MIN_TOKENS = 256
# the kernel's token buckets up to this size run its skinny form where the setting has it (`BaseGemm.skinny`): the
# tokens as the WGMMA's N side, as many as the step's real rows need (pallas_kernels/sgmv/gemm_skinny_gpu.py)
SKINNY_MAX_TOKENS = 256
# in the default setting (`BaseGemm.xla_dots`), every forward keeps XLA's dots in the kernel's buckets up to this size,
# compiled as cuBLAS GEMMs (model_executor/compiler_options.py): without adapters their tiles made an H100's decode
# step 5-8% shorter than the skinny kernel at 147, 220 and 256 rows of the 256 bucket, where the kernel won at 369 rows
# of the 512 bucket; with 32 adapters the forward tied at 147 rows and was 3-4% shorter at 200 and 256 rows
# (docs/benchmarks.md "cuBLAS in the 256 bucket without adapters", "cuBLAS in the 256 bucket with adapters")
XLA_DOTS_MAX_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class BaseGemm:
    """The model's static base-GEMM setting (a static attribute of the model and of every decoder-layer linear)."""

    min_tokens: int  # the least token bucket in which a module runs the kernel (> 0)
    mesh: Mesh | None = None  # the ("data", "tensor") mesh the weights are placed on; None: one device
    reference: bool = False  # compute with the kernel's pure-JAX reference (platforms without Mosaic GPU)
    skinny: bool = False  # buckets up to SKINNY_MAX_TOKENS run the skinny kernel
    xla_dots: bool = False  # the kernel's buckets up to XLA_DOTS_MAX_TOKENS keep XLA's dots

    def keeps_xla_dots(self, num_tokens: int) -> bool:
        """Whether a bucket of `num_tokens` tokens, one of the kernel's, keeps XLA's dots instead: the engine compiles
        its forwards, with adapters too, with cuBLAS's GEMMs (ForwardPrograms)."""
        return self.xla_dots and 0 < self.min_tokens <= num_tokens <= XLA_DOTS_MAX_TOKENS

    def runs(self, num_tokens: int) -> bool:
        """Whether a bucket of `num_tokens` tokens runs the kernel (the model's layers then get LayerStack views)."""
        return 0 < self.min_tokens <= num_tokens and not self.keeps_xla_dots(num_tokens)

    def runs_skinny(self, num_tokens: int) -> bool:
        """Whether a bucket of `num_tokens` tokens runs the kernel's skinny form."""
        return self.skinny and self.runs(num_tokens) and num_tokens <= SKINNY_MAX_TOKENS


def make_base_gemm(min_tokens: int | None, mesh: Mesh | None) -> BaseGemm | None:
    """`--gpu-gemm-min-tokens` on `mesh`'s devices -> the setting, or None when off (0). None: DEFAULT_MIN_TOKENS on
    one Hopper GPU (the skinny form, and XLA's dots in every forward, in their buckets), off elsewhere
    (several GPUs: the kernel under shard_map has not run on GPUs yet, so it waits for the flag); a positive value off
    Hopper GPUs runs the kernel's pure-JAX reference."""
    has_kernel = is_hopper(mesh.devices.flat[0] if mesh is not None else jax.devices()[0])
    if min_tokens is None and has_kernel and (mesh is None or mesh.size == 1):
        return BaseGemm(DEFAULT_MIN_TOKENS, mesh, reference=False, skinny=True, xla_dots=True)
    if not min_tokens:
        return None
    return BaseGemm(min_tokens, mesh, reference=not has_kernel)


def _weight_spec(kernel: LayerStack, config: BaseGemm, axes: LinearAxes) -> tuple[P, int, int]:
    """Where the weight loader placed the [L, in, out] stack (the layer axis is never split), and one device's in
    and out."""
    mesh, stack = config.mesh, kernel.stack
    w_spec = P(None, None, None)
    if mesh is not None and mesh.size > 1:
        w_spec = logical_to_sharding(mesh, ("layers", axes.in_axis, axes.out_axis), stack.shape).spec
    in_axis, out_axis = w_spec[1], w_spec[2]
    in_local = stack.shape[1] // (mesh.shape[in_axis] if in_axis else 1)
    out_local = stack.shape[2] // (mesh.shape[out_axis] if out_axis else 1)
    return w_spec, in_local, out_local


def fits_base_gemm(x: jax.Array, kernel: LayerStack, config: BaseGemm, axes: LinearAxes, gated: bool = False) -> bool:
    """Whether `base_gemm` runs this module on x (bfloat16 operands whose shapes fit the kernel's tiles), not None."""
    _, in_local, out_local = _weight_spec(kernel, config, axes)
    return _fits(x, kernel.stack.dtype, in_local, out_local, gated, config.runs_skinny(x.shape[0]))


def _fits(x: jax.Array, w_dtype, in_local: int, out_local: int, gated: bool, skinny: bool) -> bool:
    tiles = choose_gemm_tiles()
    if x.dtype != jnp.bfloat16 or w_dtype != x.dtype:
        return False
    try:
        if skinny:
            check_skinny_shapes(x.shape[0], in_local, out_local, SkinnyTiles())
        else:
            check_gemm_shapes(
                x.shape[0], in_local, out_local // (2 if gated else 1), tiles, tiles.tile_n if gated else None
            )
    except ValueError:
        return False
    return True


def _skinny_product(x, stack, layer, rows, reference: bool, zero_padding: bool, gated: bool, delta) -> jax.Array:
    """The skinny kernel's product; gated: silu(gate (+ delta_gate)) * (up (+ delta_up)) by XLA after it, each sum
    rounded as the unfused layers round it, zero from rows[0] on."""
    y = gemm_skinny_gpu(x, stack, layer, rows, reference=reference, zero_padding=zero_padding and not gated)
    if not gated:
        return y
    y = y if delta is None else y + delta
    return zero_rows_from(silu_and_mul(y), rows)


def base_gemm(
    x: jax.Array,
    kernel: LayerStack,
    config: BaseGemm,
    axes: LinearAxes,
    num_rows: jax.Array | None = None,
    gated: bool = False,
    zero_padding: bool = True,
    delta: jax.Array | None = None,
) -> jax.Array | None:
    """x [T, in] @ the layer's W of `kernel` ([L, in, out] stack) with the kernel, in x's dtype: the packed output
    [T, out], all-reduced for row-parallel modules; None when the module does not fit the kernel. num_rows ([1]
    i32): the step's real tokens (the kernel skips the row tiles of the padding after them, zero in the output;
    None: every row). zero_padding=False: those rows may hold any values instead (no select zeroes them; for a
    consumer that masks them, gemm_gpu.py `gemm_gpu`). gated (a column-parallel [gate | up] module): silu(gate) * up
    [T, out / 2] instead, from the kernel's epilogue; each device's columns are its [gate | up] shard (the
    shard-major packing), so its output is its columns of the activation. delta (gated only; [T, out] in x's dtype,
    packed as the product, each device its columns): gate|up's LoRA delta, added to the product before the
    activation in the kernel's epilogue (LoRALinear.silu_and_mul)."""
    mesh, stack = config.mesh, kernel.stack
    w_spec, in_local, out_local = _weight_spec(kernel, config, axes)
    in_axis, out_axis = w_spec[1], w_spec[2]
    if gated and in_axis:
        raise ValueError("base_gemm: gated is for column-parallel modules (W not split on its input)")
    skinny = config.runs_skinny(x.shape[0])
    if not _fits(x, stack.dtype, in_local, out_local, gated, skinny):
        return None

    rows = rows_operand(num_rows, x.shape[0])

    def local(x, stack, layer, rows, delta):
        if skinny:
            y = _skinny_product(x, stack, layer, rows, config.reference, zero_padding, gated, delta)
            return jax.lax.psum(y, in_axis) if in_axis else y
        # the default tiles; split K or the tail split where they pay
        options = dict(gated=gated, delta=delta, reference=config.reference, zero_padding=zero_padding)
        y = gemm_gpu(x, stack, layer, rows, **options)
        return jax.lax.psum(y, in_axis) if in_axis else y

    if mesh is None or mesh.size == 1:
        return local(x, stack, kernel.layer, rows, delta)
    in_specs = (P(None, in_axis), w_spec, P(), P(), P(None, out_axis))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(None, out_axis), check_vma=False)
    return sharded(x, stack, kernel.layer, rows, delta)
