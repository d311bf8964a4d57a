"""PallasBackend: what the TPU and GPU Pallas LoRA backends share, and `make_pallas_backend` (`--lora-backend
pallas`), which picks the platform's class: PallasTPUBackend (lora/backend/pallas_tpu.py, the Mosaic kernels) on
TPU, PallasGPUBackend (lora/backend/pallas_gpu.py, the Triton kernels) elsewhere; on CPU that one runs its
kernels in interpret mode.

Where it sits: behind the backend interface (lora/backend/base.py), over the SGMV kernels of
`pallas_kernels/sgmv/`. A subclass supplies the per-shard kernels (`_local_shrink_partials`, `_local_expand`);
this class wraps them for a mesh and composes them in `apply_packed` (and `packed_delta`, the delta alone).
Pallas calls do not take part in GSPMD propagation, so with a multi-device mesh every call runs under
`jax.shard_map` over that mesh: column-parallel (`output_sharded`): x, s and A replicated, B and the result split on `out`; row-parallel
(`input_sharded`): x and A split on `in`, the [T, R] shrink partials summed by `psum` over 'tensor' (the only
collective), B replicated. The token dimension is never split.

Both kernels take the model's layer-stacked buffers (LayerStack views) and read the layer in place
(`reads_stacked`): the Triton kernels offset their pointers, the Mosaic kernels scalar-prefetch the layer index
into their weight index maps. `shrink` and `expand` run one kernel alone over a LoRABatch (tests and
benchmarks; the engine calls `apply_packed`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.layer_stack import LayerStack, as_layer_array
from sgl_jax_lora.lora.backend.base import TENSOR_AXIS, LoRABackend, LoRAMeta
from sgl_jax_lora.lora.lora_batch import LoRABatch

REPLICATED = P()
IN_SPLIT_X = P(None, TENSOR_AXIS)  # x [T, in]
IN_SPLIT_A = P(None, None, TENSOR_AXIS)  # A [A, R, in]
OUT_SPLIT_B = P(None, TENSOR_AXIS, None)  # B [A, out, R]
OUT_SPLIT_Y = P(None, TENSOR_AXIS)  # y [T, out]


def stacked_spec(spec: P, is_stacked: bool) -> P:
    """The spec of a layer-stacked buffer ([L, ...]): the layer axis is never split."""
    return P(None, *spec) if is_stacked else spec


def mesh_platform(mesh: Mesh | None) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


class PallasBackend(LoRABackend):
    name = "pallas"
    reads_stacked = True  # both kernels offset into the [L, A, ...] stacks by the layer index
    native_platforms: tuple[str, ...] = ()  # where the kernels compile; elsewhere they run in interpret mode
    # column-parallel modules with a delta: `delta_holding_input` orders the shrink before the base GEMM
    shrink_first = False

    def __init__(self, mesh: Mesh | None = None, interpret: bool | None = None):
        super().__init__(mesh)
        self.interpret = mesh_platform(mesh) not in self.native_platforms if interpret is None else interpret

    # -- what a platform's class supplies ----------------------------------------------------------------------

    @abc.abstractmethod
    def _local_shrink_partials(
        self, x: jax.Array, lora_a: jax.Array, meta: LoRAMeta, rank_block: int | None, layer: jax.Array | None = None
    ) -> jax.Array:
        """[splits, T, R] f32 partial sums on one shard. lora_a is [A, R, in], or the [L, A, R, in] stack with
        `layer`."""

    @abc.abstractmethod
    def _local_expand(
        self,
        s: jax.Array,
        lora_bs: tuple[jax.Array, ...],
        meta: LoRAMeta,
        scale: jax.Array | None,
        base_out: jax.Array | None,
        out_dtype: jnp.dtype,
        layer: jax.Array | None = None,
    ) -> jax.Array:
        """Every part's delta into its columns of the (packed) output, added to base_out when given: part p
        reads columns p*R .. (p+1)*R of s ([T, P*R], or [splits, T, P*R] partials to sum). lora_bs are
        [A, out_p, R], or [L, A, out_p, R] stacks with `layer`."""

    def returns_delta(self, input_sharded: bool) -> bool:
        """Whether `apply_packed` has its expand write the delta alone, for XLA to add to the base output,
        rather than add it into the base output in place."""
        return False

    def fits_stacks(self, buffers: tuple[LayerStack, ...]) -> bool:
        """Whether the kernels can read these whole layer stacks (else they get one layer's slice)."""
        return True

    def fused_gemm_tile_rows(self, num_tokens: int, num_segments: int) -> int:
        """Row tile of the GEMM with the LoRA inside it when this backend runs it for a (token bucket, segment
        bucket) of prefill; 0 = never."""
        return 0

    # -- sharding --------------------------------------------------------------------------------------------

    def _sharded(self, fn: Callable, in_specs: tuple, out_specs: P) -> Callable:
        if self.mesh is None or self.mesh.size == 1:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _is_split(self, input_sharded: bool) -> bool:
        """Whether `in` is split over several devices, so that the shrink's partial sums need an all-reduce."""
        return input_sharded and self.mesh is not None and self.mesh.size > 1

    # -- one kernel alone (tests, benchmarks) -------------------------------------------------------------------

    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        """x [T, in], lora_a [A, R, in] -> [T, R] float32, x_t @ A[slot_t].T (row-parallel: all-reduced)."""

        def local(x, lora_a, meta):
            s = self._local_shrink_partials(x, lora_a, meta, rank_block).sum(0)
            return jax.lax.psum(s, TENSOR_AXIS) if self._is_split(input_sharded) else s

        specs = (IN_SPLIT_X, IN_SPLIT_A, REPLICATED) if input_sharded else (REPLICATED,) * 3
        return self._sharded(local, specs, REPLICATED)(x, lora_a, LoRAMeta(lora))

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        """s [T, R] float32, lora_b [A, out, R] -> [T, out] out_dtype, s_t @ B[slot_t].T."""

        def local(s, lora_b, meta):
            return self._local_expand(s, (lora_b,), meta, None, None, out_dtype)

        b_spec = OUT_SPLIT_B if output_sharded else REPLICATED
        y_spec = OUT_SPLIT_Y if output_sharded else REPLICATED
        return self._sharded(local, (REPLICATED, b_spec, REPLICATED), y_spec)(s, lora_b, LoRAMeta(lora))

    # -- the interface ------------------------------------------------------------------------------------------

    def apply_packed(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        base_out: jax.Array,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array:
        sharding = dict(input_sharded=input_sharded, output_sharded=output_sharded)
        if self.returns_delta(input_sharded):
            return base_out + self._shrink_expand(x, lora_a, lora_bs, meta, None, base_out.dtype, **sharding)
        return self._shrink_expand(x, lora_a, lora_bs, meta, base_out, base_out.dtype, **sharding)

    def packed_delta(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        *,
        tp_size: int,
    ) -> jax.Array | None:
        if not self.gives_packed_delta(x.shape[0]):
            return None
        return self._shrink_expand(x, lora_a, lora_bs, meta, None, x.dtype, input_sharded=False, output_sharded=True)

    def delta_holding_input(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        *,
        tp_size: int,
    ) -> tuple[jax.Array, jax.Array] | None:
        if not (self.shrink_first and self.returns_delta(False)):
            return None
        sharding = dict(input_sharded=False, output_sharded=True)
        return self._shrink_expand(x, lora_a, lora_bs, meta, None, x.dtype, hold_input=True, **sharding)

    def gives_packed_delta(self, num_tokens: int) -> bool:
        """Whether `packed_delta` hands a column-parallel module's delta over in a bucket of num_tokens tokens."""
        return False

    def _shrink_expand(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        base_out: jax.Array | None,
        out_dtype: jnp.dtype,
        *,
        input_sharded: bool,
        output_sharded: bool,
        hold_input: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """The shrink, then the expand of every part: added into base_out in place, or (None) the delta alone;
        hold_input: (the delta, x held behind the shrink by an optimization barrier)."""
        buffers = (lora_a, *lora_bs)
        is_stacked = all(isinstance(w, LayerStack) for w in buffers) and self.fits_stacks(buffers)
        if is_stacked:
            layer, lora_a, lora_bs = lora_a.layer, lora_a.stack, tuple(b.stack for b in lora_bs)
        else:
            layer = jnp.zeros((), jnp.int32)
            lora_a, lora_bs = as_layer_array(lora_a), tuple(as_layer_array(b) for b in lora_bs)
        max_rank = lora_bs[0].shape[-1]
        adds_in_place = base_out is not None

        def local(x, lora_a, meta, layer, *operands):
            # operands: one B per part, then the base output when the delta is added in place; per shard, the
            # packed output is [part 0 | part 1 | ...] of each part's local columns
            lora_bs, y = (operands[:-1], operands[-1]) if adds_in_place else (operands, None)
            s = self._local_shrink_partials(x, lora_a, meta, max_rank, layer)
            if self._is_split(input_sharded):  # else the expand kernel sums the partials as it loads them
                s = jax.lax.psum(s.sum(0), TENSOR_AXIS)
            if hold_input:
                s, x = jax.lax.optimization_barrier((s, x))
            out = self._local_expand(s, lora_bs, meta, meta.batch.slot_scale, y, out_dtype, layer)
            return (out, x) if hold_input else out

        x_spec, a_spec = (IN_SPLIT_X, IN_SPLIT_A) if input_sharded else (REPLICATED, REPLICATED)
        b_spec, y_spec = (OUT_SPLIT_B, OUT_SPLIT_Y) if output_sharded else (REPLICATED, REPLICATED)
        a_spec, b_spec = stacked_spec(a_spec, is_stacked), stacked_spec(b_spec, is_stacked)
        specs = (x_spec, a_spec, REPLICATED, REPLICATED) + (b_spec,) * len(lora_bs)
        operands = (x, lora_a, meta, layer, *lora_bs)
        if adds_in_place:
            return self._sharded(local, specs + (y_spec,), y_spec)(*operands, base_out)
        return self._sharded(local, specs, (y_spec, x_spec) if hold_input else y_spec)(*operands)


def make_pallas_backend(
    mesh: Mesh | None = None, *, interpret: bool | None = None, fused_gemm_min_tokens: int | None = None
) -> PallasBackend:
    """The platform's Pallas backend (`--lora-backend pallas`): the Mosaic kernels on TPU, the Triton kernels
    elsewhere (interpret mode off CUDA GPUs). fused_gemm_min_tokens: PallasGPUBackend's (TPUs have no GEMM with
    the LoRA inside it)."""
    from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend
    from sgl_jax_lora.lora.backend.pallas_tpu import PallasTPUBackend

    if mesh_platform(mesh) == "tpu":
        return PallasTPUBackend(mesh, interpret=interpret)
    return PallasGPUBackend(mesh, interpret=interpret, fused_gemm_min_tokens=fused_gemm_min_tokens)
