"""Pallas LoRA backend: the SGMV kernels of `pallas_kernels/sgmv/` behind the backend interface.

Kernel choice: the Mosaic kernel on TPU, the Triton kernel on CUDA GPUs, and elsewhere (CPU) the Triton
kernel in interpret mode. Pallas calls do not take part in GSPMD propagation, so with a multi-device mesh
every call runs under `jax.shard_map` over that mesh: column-parallel (`output_sharded`): x, s and A
replicated, B and the result split on `out`; row-parallel (`input_sharded`): x and A split on `in`, the
[T, R] shrink partials summed by `psum` over 'tensor' (the only collective), B replicated. The token
dimension is never split.

Rank awareness: GPU kernel masks A rows above each slot's rank, and B columns from the rank rounded up to 8,
out of its loads (those bytes are never read) and reads nothing for base segments; TPU kernel skips the
matmul of base segments but its weight DMA always moves the full R (static block shape). See
docs/lora_backends.md.

Projection sizes: any. The GPU kernels mask their last `in` / `out` block past sizes no block divides; the TPU
kernels pad such sizes to 128 lanes at trace time and slice back (docs/lora_backends.md "Projection sizes").

GPU `apply` / `apply_packed` fuse the whole LoRA: the shrink partials go straight into the expand kernel,
which sums them, applies the slot scale and adds into the (packed) base output in place; a packed module
(q|k|v, gate|up) is one shrink launch plus one expand launch for all its parts, with no XLA op between
them, except that in GPU decode buckets q|k|v's expand writes its delta for XLA to add (`returns_delta`).
The work list comes with the step's LoRABatch (the model builds it once per forward) when its row
tiles match the kernel's. TPU `apply_packed` runs one shrink and one expand per part, its deltas packed
side by side and added to the base output. Both take the model's layer-stacked buffers (LayerStack views)
and their kernels read the layer in place (`reads_stacked`): the Triton kernels offset their pointers, the
Mosaic kernels scalar-prefetch the layer index into their weight index maps.

Prefill on Hopper GPUs (`fused_gemm_tile_rows`, `apply_with_base`): from `--lora-fused-gemm-min-tokens` tokens
(default FUSED_GEMM_MIN_TOKENS), each LoRA module that fits computes its base GEMM and every part's expand in
one Mosaic GPU kernel (pallas_kernels/sgmv/gemm_lora_gpu.py) after the SGMV shrink; the model hands over the
module's base weight as a layer-stack view and the batch's entry table. A module that kernel cannot take (its
tiles, rank or dtype) gets None from `apply_with_base` and runs the base GEMM and the SGMV kernels. Elsewhere a positive flag value runs
that path with the kernel's pure-JAX reference (CPU tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.sgmv.gemm_lora_gpu import (
    GemmLoraTiles,
    check_gemm_lora_shapes,
    choose_gemm_lora_tiles,
    gemm_lora_gpu,
)
from pallas_kernels.sgmv.gpu import choose_tiles, fits_stacked_offsets, sgmv_expand_gpu, sgmv_shrink_gpu_partials
from pallas_kernels.sgmv.tpu import sgmv_expand_tpu, sgmv_shrink_tpu
from pallas_kernels.sgmv.work_list import gpu_block_rows
from sgl_jax_lora.lora.backend.base import TENSOR_AXIS, LoRABackend
from sgl_jax_lora.lora.layer_stack import LayerStack, as_layer_array, layer_shape
from sgl_jax_lora.lora.lora_batch import LoRABatch

KERNELS = ("tpu", "gpu")

_REPLICATED = P()
_IN_SPLIT_X = P(None, TENSOR_AXIS)  # x [T, in]
_IN_SPLIT_A = P(None, None, TENSOR_AXIS)  # A [A, R, in]
_OUT_SPLIT_B = P(None, TENSOR_AXIS, None)  # B [A, out, R]
_OUT_SPLIT_Y = P(None, TENSOR_AXIS)  # y [T, out]
_IN_SPLIT_W = P(TENSOR_AXIS, None)  # base weight [in, out] of a row-parallel layer
_OUT_SPLIT_W = P(None, TENSOR_AXIS)  # ... of a column-parallel layer


def _stacked_spec(spec: P, is_stacked: bool) -> P:
    """The spec of a layer-stacked buffer ([L, ...]): the layer axis is never split."""
    return P(None, *spec) if is_stacked else spec


def _platform(mesh: Mesh | None) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _is_hopper(mesh: Mesh | None) -> bool:
    """Whether the devices are CUDA GPUs of compute capability 9.x (WGMMA and TMA: the Mosaic GPU GEMM)."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return device.platform in ("gpu", "cuda") and str(getattr(device, "compute_capability", "0")).startswith("9")


class PallasBackend(LoRABackend):
    name = "pallas"
    # returns_delta's limits: q|k|v of Llama-3-8B (6144 columns) measured at 64 tokens; gate|up (28672) stays in place
    DELTA_MAX_TOKENS = 128
    DELTA_MAX_WIDTH = 16384
    # prefill buckets from this many tokens run the GEMM with the LoRA inside it on Hopper GPUs
    FUSED_GEMM_MIN_TOKENS = (
        512  # measured from 512 (docs/benchmarks.md "Prefill rows, as the engine calls the modules"); SGMV below
    )

    def __init__(
        self,
        mesh: Mesh | None = None,
        kernel: str | None = None,
        interpret: bool | None = None,
        fused_gemm_min_tokens: int | None = None,
    ):
        """fused_gemm_min_tokens: the least prefill bucket that runs the base GEMM with the LoRA inside it (0:
        none). Default: FUSED_GEMM_MIN_TOKENS on Hopper GPUs, 0 elsewhere; given elsewhere (CPU tests), that
        path computes with the kernel's pure-JAX reference."""
        super().__init__(mesh)
        platform = _platform(mesh)
        if kernel is None:
            kernel = "tpu" if platform == "tpu" else "gpu"
        if kernel not in KERNELS:
            raise ValueError(f"pallas kernel {kernel!r}: choose one of {KERNELS}")
        native = {"tpu": ("tpu",), "gpu": ("gpu", "cuda")}[kernel]
        self.kernel = kernel
        self.interpret = platform not in native if interpret is None else interpret
        has_gemm_kernel = kernel == "gpu" and not self.interpret and _is_hopper(mesh)
        if fused_gemm_min_tokens is None:
            fused_gemm_min_tokens = self.FUSED_GEMM_MIN_TOKENS if has_gemm_kernel else 0
        self.fused_gemm_min_tokens = fused_gemm_min_tokens
        self.fused_gemm_reference = not has_gemm_kernel

    # -- sharding -------------------------------------------------------------------------------------------

    def _sharded(self, fn, in_specs: tuple, out_specs: P):
        if self.mesh is None or self.mesh.size == 1:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _is_split(self, input_sharded: bool) -> bool:
        """Whether `in` is split over several devices, so that the shrink's partial sums need an all-reduce."""
        return input_sharded and self.mesh is not None and self.mesh.size > 1

    def _psum(self, value: jax.Array, input_sharded: bool) -> jax.Array:
        return jax.lax.psum(value, TENSOR_AXIS) if self._is_split(input_sharded) else value

    def returns_delta(self, num_tokens: int, out_width: int, input_sharded: bool) -> bool:
        """Whether `apply_packed` has its expand write the delta alone, for XLA to add to the base output,
        rather than add it into the base output in place.

        GPU decode buckets (up to DELTA_MAX_TOKENS tokens) of column-parallel modules up to DELTA_MAX_WIDTH
        output columns (q|k|v): XLA splits these GEMMs along K, and an in-place expand, which needs the
        GEMM's result, makes XLA finish the split-K sum in a kernel of its own; a delta lets that sum fuse
        with the add into the consumers (docs/lora_backends.md "Delta or in place")."""
        return (
            self.kernel == "gpu"
            and not input_sharded
            and num_tokens <= self.DELTA_MAX_TOKENS
            and out_width <= self.DELTA_MAX_WIDTH
        )

    # -- local (per-shard) kernels ----------------------------------------------------------------------------

    def work_block_rows(self, num_tokens: int, num_segments: int) -> int:
        return gpu_block_rows(num_tokens) if self.kernel == "gpu" else 0

    def reads_stacked(self, num_tokens: int, num_segments: int, out_features: int = 0) -> bool:
        return True  # both kernels offset into the [L, A, ...] stacks by the layer index

    @staticmethod
    def _gpu_work(lora: LoRABatch, block_rows: int) -> tuple:
        """The batch's precomputed (work list, padded perm) when built for these row tiles, else (None, None)."""
        if lora.work is not None and lora.work_block_rows == block_rows:
            return lora.work, lora.work_perm
        return None, None

    def _local_shrink_partials(
        self, x: jax.Array, lora_a: jax.Array, lora: LoRABatch, rank_block: int | None, layer: jax.Array | None = None
    ) -> jax.Array:
        """[splits, T, R] f32 partial sums on one shard (TPU: a single split). lora_a is [A, R, in], or the
        [L, A, R, in] stack with `layer`."""
        meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
        if self.kernel == "tpu":
            return sgmv_shrink_tpu(x, lora_a, *meta, layer, rank_block=rank_block, interpret=self.interpret)[None]
        tiles = choose_tiles(x.shape[0], lora.num_segments, x.shape[1], None)
        return sgmv_shrink_gpu_partials(
            x,
            lora_a,
            *meta,
            *self._gpu_work(lora, tiles.block_rows),
            layer,
            tiles=tiles,
            rank_block=rank_block,
            interpret=self.interpret,
        )

    def _local_expand(
        self,
        s: jax.Array,
        lora_bs: tuple[jax.Array, ...],
        lora: LoRABatch,
        scale: jax.Array | None,
        base_out: jax.Array | None,
        out_dtype: jnp.dtype,
        layer: jax.Array | None = None,
    ) -> jax.Array:
        """Every part's delta (GPU: one launch) into its columns of the (packed) output: part p reads columns
        p*R .. (p+1)*R of s. lora_bs are [A, out_p, R], or [L, A, out_p, R] stacks with `layer`."""
        meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
        if self.kernel == "tpu":  # one launch per part, each part's columns side by side (the shard's packed layout)
            s2 = s.sum(0) if s.ndim == 3 else s
            if scale is not None:
                s2 = s2 * scale[lora.token_slot][:, None]
            max_rank = lora_bs[0].shape[-1]
            deltas = [
                sgmv_expand_tpu(
                    s2[:, i * max_rank : (i + 1) * max_rank],
                    b,
                    *meta,
                    layer,
                    out_dtype=out_dtype,
                    interpret=self.interpret,
                )
                for i, b in enumerate(lora_bs)
            ]
            delta = deltas[0] if len(deltas) == 1 else jnp.concatenate(deltas, axis=1)
            if base_out is None:
                return delta
            return (base_out.astype(jnp.float32) + delta.astype(jnp.float32)).astype(out_dtype)
        num_tokens = s.shape[-2]
        tiles = choose_tiles(num_tokens, lora.num_segments, None, tuple(b.shape[-2] for b in lora_bs))
        return sgmv_expand_gpu(
            s,
            lora_bs,
            *meta,
            scale,
            base_out,
            *self._gpu_work(lora, tiles.block_rows),
            layer,
            out_dtype=out_dtype,
            tiles=tiles,
            interpret=self.interpret,
        )

    # -- interface -------------------------------------------------------------------------------------------

    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        def local(x, lora_a, lora):
            s = self._local_shrink_partials(x, lora_a, lora, rank_block).sum(0)
            return self._psum(s, input_sharded)

        specs = (_IN_SPLIT_X, _IN_SPLIT_A, _REPLICATED) if input_sharded else (_REPLICATED,) * 3
        return self._sharded(local, specs, _REPLICATED)(x, lora_a, lora)

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        def local(s, lora_b, lora):
            return self._local_expand(s, (lora_b,), lora, None, None, out_dtype)

        b_spec = _OUT_SPLIT_B if output_sharded else _REPLICATED
        y_spec = _OUT_SPLIT_Y if output_sharded else _REPLICATED
        return self._sharded(local, (_REPLICATED, b_spec, _REPLICATED), y_spec)(s, lora_b, lora)

    def apply(
        self,
        x: jax.Array,  # [T, in]
        lora_a: jax.Array,  # [A, R, in]
        lora_b: jax.Array,  # [A, out, R]
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        output_sharded: bool = False,
        base_out: jax.Array | None = None,  # [T, out]
    ) -> jax.Array:
        out_dtype = x.dtype if base_out is None else base_out.dtype

        def local(x, lora_a, lora_b, lora, *base):
            s = self._local_shrink_partials(x, lora_a, lora, lora_a.shape[1])
            if self._is_split(input_sharded):  # else the expand kernel sums the partials as it loads them
                s = jax.lax.psum(s.sum(0), TENSOR_AXIS)
            return self._local_expand(s, (lora_b,), lora, lora.slot_scale, base[0] if base else None, out_dtype)

        x_spec, a_spec = (_IN_SPLIT_X, _IN_SPLIT_A) if input_sharded else (_REPLICATED, _REPLICATED)
        b_spec, y_spec = (_OUT_SPLIT_B, _OUT_SPLIT_Y) if output_sharded else (_REPLICATED, _REPLICATED)
        specs = (x_spec, a_spec, b_spec, _REPLICATED) + ((y_spec,) if base_out is not None else ())
        operands = (x, lora_a, lora_b, lora) + ((base_out,) if base_out is not None else ())
        return self._sharded(local, specs, y_spec)(*operands)

    def apply_packed(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        lora: LoRABatch,
        base_out: jax.Array,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array:
        buffers = (lora_a, *lora_bs)
        is_stacked = all(isinstance(w, LayerStack) for w in buffers)
        if is_stacked and self.kernel == "gpu" and not all(fits_stacked_offsets(w.stack.shape) for w in buffers):
            is_stacked = False  # too large for the Triton kernels' int32 offsets: read one layer's slice
        if is_stacked:
            layer, lora_a, lora_bs = lora_a.layer, lora_a.stack, tuple(b.stack for b in lora_bs)
        else:
            layer = jnp.zeros((), jnp.int32)
            lora_a, lora_bs = as_layer_array(lora_a), tuple(as_layer_array(b) for b in lora_bs)
        max_rank = lora_bs[0].shape[-1]
        out_width = sum(b.shape[-2] for b in lora_bs)  # all parts, every shard
        adds_in_place = not self.returns_delta(x.shape[0], out_width, input_sharded)

        def local(x, lora_a, lora, layer, *operands):
            # operands: one B per part, then the base output when the delta is added in place; per shard, the
            # packed output is [part 0 | part 1 | ...] of each part's local columns
            lora_bs, y = (operands[:-1], operands[-1]) if adds_in_place else (operands, None)
            s = self._local_shrink_partials(x, lora_a, lora, max_rank, layer)
            if self._is_split(input_sharded):  # else the expand kernel sums the partials as it loads them
                s = jax.lax.psum(s.sum(0), TENSOR_AXIS)
            return self._local_expand(s, lora_bs, lora, lora.slot_scale, y, base_out.dtype, layer)

        x_spec, a_spec = (_IN_SPLIT_X, _IN_SPLIT_A) if input_sharded else (_REPLICATED, _REPLICATED)
        b_spec, y_spec = (_OUT_SPLIT_B, _OUT_SPLIT_Y) if output_sharded else (_REPLICATED, _REPLICATED)
        a_spec, b_spec = _stacked_spec(a_spec, is_stacked), _stacked_spec(b_spec, is_stacked)
        specs = (x_spec, a_spec, _REPLICATED, _REPLICATED) + (b_spec,) * len(lora_bs)
        operands = (x, lora_a, lora, layer, *lora_bs)
        if adds_in_place:
            return self._sharded(local, specs + (y_spec,), y_spec)(*operands, base_out)
        return base_out + self._sharded(local, specs, y_spec)(*operands)

    # -- the base GEMM with the LoRA inside it (prefill) ---------------------------------------------------------

    def fused_gemm_tile_rows(self, num_tokens: int, num_segments: int) -> int:
        tile_m = GemmLoraTiles.tile_m
        if self.fused_gemm_min_tokens and num_tokens >= self.fused_gemm_min_tokens and num_tokens % tile_m == 0:
            return tile_m
        return 0

    def _fused_gemm_tiles(self, x: jax.Array, in_local: int, widths_local: tuple[int, ...], rank: int, lora: LoRABatch):
        """The kernel's tiles when this module fits the fused GEMM, else None."""
        if lora.entries is None or x.dtype != jnp.bfloat16:
            return None
        try:
            tiles = choose_gemm_lora_tiles(rank)
            check_gemm_lora_shapes(x.shape[0], in_local, widths_local, rank, tiles)
        except ValueError:
            return None
        return tiles if lora.entries.tile_m == tiles.tile_m else None

    def apply_with_base(
        self,
        x: jax.Array,
        kernel: jax.Array | LayerStack,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        lora: LoRABatch,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array | None:
        """The SGMV shrink kernel, then pallas_kernels/sgmv/gemm_lora_gpu.py: x @ W with each part's expand added
        into the GEMM's accumulator. Row-parallel layers (`input_sharded` over several devices) add the delta on
        the first shard only, before the all-reduce of the partial outputs."""
        rank = layer_shape(lora_bs[0])[-1]
        in_local = layer_shape(kernel)[-2] // (tp_size if input_sharded else 1)
        widths_local = tuple(layer_shape(b)[-2] // (tp_size if output_sharded else 1) for b in lora_bs)
        tiles = self._fused_gemm_tiles(x, in_local, widths_local, rank, lora)
        if tiles is None:
            return None
        weights = (kernel, *lora_bs)  # read by the GEMM kernel, at any size
        if all(isinstance(w, LayerStack) for w in weights):
            layer, stacks = kernel.layer, tuple(w.stack for w in weights)
        else:  # unstacked callers: stacks of one layer
            layer, stacks = jnp.zeros((), jnp.int32), tuple(as_layer_array(w)[None] for w in weights)
        if isinstance(lora_a, LayerStack) and fits_stacked_offsets(lora_a.stack.shape):
            a_layer, a_stack = lora_a.layer, lora_a.stack
        else:  # the Triton shrink's int32 offsets cannot reach every layer of this stack: its layer's slice
            a_layer, a_stack = jnp.zeros((), jnp.int32), as_layer_array(lora_a)[None]
        is_split = self._is_split(input_sharded)

        def local(x, w, lora_a, lora, layers, *lora_bs):
            layer, a_layer = layers[0], layers[1]
            s = self._local_shrink_partials(x, lora_a, lora, rank, a_layer).sum(0)
            table = lora.entries
            if is_split:
                s = jax.lax.psum(s, TENSOR_AXIS)
                is_first = jax.lax.axis_index(TENSOR_AXIS) == 0
                table = dataclasses.replace(table, entry_start=jnp.where(is_first, table.entry_start, 0))
            y = gemm_lora_gpu(x, w, s, table, lora_bs, layer, tiles=tiles, reference=self.fused_gemm_reference)
            return jax.lax.psum(y, TENSOR_AXIS) if is_split else y

        x_spec, a_spec = (_IN_SPLIT_X, _IN_SPLIT_A) if input_sharded else (_REPLICATED, _REPLICATED)
        w_spec = _IN_SPLIT_W if input_sharded else _OUT_SPLIT_W if output_sharded else _REPLICATED
        b_spec, y_spec = (_OUT_SPLIT_B, _OUT_SPLIT_Y) if output_sharded else (_REPLICATED, _REPLICATED)
        specs = (x_spec, _stacked_spec(w_spec, True), _stacked_spec(a_spec, True), _REPLICATED, _REPLICATED)
        specs += (_stacked_spec(b_spec, True),) * len(lora_bs)
        layers = jnp.stack([layer, a_layer]).astype(jnp.int32)
        return self._sharded(local, specs, y_spec)(x, stacks[0], a_stack, lora, layers, *stacks[1:])
