"""PallasGPUBackend: the Triton SGMV kernels (pallas_kernels/sgmv/gpu.py) and, in prefill on Hopper GPUs, the
Mosaic GPU GEMM with the LoRA inside it (pallas_kernels/sgmv/gemm_lora_gpu.py), behind the backend interface.

Where it sits: `--lora-backend pallas` off TPU (make_pallas_backend, lora/backend/pallas.py, which also holds
the sharding and the `apply_packed` both Pallas backends share); on CPU its kernels run in interpret mode.
What exists here: `PallasGPUMeta` (the step's metadata), `PallasGPUBackend`, `entry_table` and
`prepare_on_host` (the same metadata built with numpy, for tests and benchmarks).

Metadata (`prepare`, once per forward inside jit, a few tiny device ops): the kernels' work list for the token
bucket's row tiles (pallas_kernels/sgmv/work_list.py), shared by every layer's kernels; and in the prefill
buckets that take the fused GEMM (`fused_gemm_tile_rows`), that kernel's entry table (`runs_base_gemm`).

Rank awareness: the kernels mask A rows above each slot's rank, and B columns from the rank rounded up to 8, out
of their loads (those bytes are never read) and read nothing for base segments. Projection sizes: any; the
kernels mask their last `in` / `out` block past sizes no block divides.

`apply_packed` fuses the whole LoRA: the shrink partials go straight into the expand kernel, which sums them and
applies the slot scale; a packed module (q|k|v, gate|up) is one shrink launch plus one expand launch for all its
parts, with no XLA op between them. The expand writes a column-parallel module's delta for XLA to add
(`returns_delta`), so it runs beside the base GEMM, and adds a row-parallel module's into the residual in place.
A column-parallel module's shrink comes before its base GEMM in the program (`shrink_first`: LoRALinear gives the GEMM x
held behind the shrink, `delta_holding_input`); in the step's CUDA graph that order does not hold the GEMM back
(docs/lora_backends.md "Delta or in place").

Large token buckets on Hopper GPUs (`apply_with_base`; decode rows, prefill chunks or both): each LoRA module that
fits computes its base GEMM and every part's expand in one Mosaic GPU kernel after the SGMV shrink, its K loop split
where its tiles leave SMs idle; the model hands over the module's base weight as a layer-stack view. By default
gate|up does from FUSED_GEMM_MIN_TOKENS tokens and q|k|v, o and down from FUSED_GEMM_OTHER_MIN_TOKENS
(`takes_fused_gemm`); `--lora-fused-gemm-min-tokens` sets one threshold for every module. A module that kernel
cannot take (its tiles, rank or dtype) or that its threshold keeps out gets None from `apply_with_base` and runs the
base GEMM and the SGMV kernels. Elsewhere a positive flag value runs that path with the kernel's pure-JAX reference
(CPU tests).
gate|up (`gated`) takes the kernel with the MLP's activation in its epilogue from GATED_MIN_TOKENS tokens: in
smaller buckets, decode rows of many adapters, its tiles (half as wide) each run every entry of their rows, and the
product then XLA's activation is faster.

Below the fused GEMM's buckets, gate|up's delta goes to the base GEMM kernel's gated epilogue (`packed_delta`,
`gives_packed_delta`; on Hopper GPUs by default, `gated_delta`): the shrink and the expand run first, and the
kernel adds the delta before the activation, so neither the [T, 2I] product nor XLA's activation pass over it
and the delta is spent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.sgmv.entry_table import EntryTable, build_entry_table
from pallas_kernels.sgmv.gemm_gpu import is_hopper
from pallas_kernels.sgmv.gemm_lora_gpu import (
    GemmLoraTiles,
    check_gemm_lora_shapes,
    choose_gemm_lora_split,
    choose_gemm_lora_tiles,
    gemm_lora_gpu,
    rows_operand,
)
from pallas_kernels.sgmv.gpu import choose_tiles, fits_stacked_offsets, sgmv_expand_gpu, sgmv_shrink_gpu_partials
from pallas_kernels.sgmv.work_list import WorkList, gpu_block_rows, make_work_list, make_work_list_host, padded_perm
from sgl_jax_lora.layers.layer_stack import LayerStack, as_layer_array, layer_shape
from sgl_jax_lora.lora.backend.base import TENSOR_AXIS, LoRAMeta
from sgl_jax_lora.lora.backend.pallas import (
    IN_SPLIT_A,
    IN_SPLIT_X,
    OUT_SPLIT_B,
    OUT_SPLIT_Y,
    REPLICATED,
    PallasBackend,
    stacked_spec,
)
from sgl_jax_lora.lora.lora_batch import LoRABatch, max_lora_runs

_IN_SPLIT_W = P(TENSOR_AXIS, None)  # base weight [in, out] of a row-parallel layer
_OUT_SPLIT_W = P(None, TENSOR_AXIS)  # ... of a column-parallel layer


@dataclasses.dataclass(frozen=True)
class PallasGPUMeta(LoRAMeta):
    work: WorkList | None = None  # (row tile, segment) items for row tiles of `work_block_rows`
    work_perm: jax.Array | None = None  # [T rounded up to work_block_rows] i32 sort_perm padded with T
    work_block_rows: int = 0  # static; 0 = no precomputed work list (the kernels build theirs)
    entries: EntryTable | None = None  # runs of one adapter per row tile, for the GEMM with the LoRA inside it

    @property
    def runs_base_gemm(self) -> bool:
        return self.entries is not None


jax.tree_util.register_dataclass(
    PallasGPUMeta, data_fields=["batch", "work", "work_perm", "entries"], meta_fields=["work_block_rows"]
)


def entry_table(lora: LoRABatch, tile_rows: int, num_seqs: int, max_chunks: int | None = None) -> EntryTable:
    """The entry table of the GEMM that has the LoRA inside it, for row tiles of `tile_rows`, built inside jit.

    Its static size is a bound that holds for every batch of the bucket. An entry is a (row tile, run of one
    adapter) pair. Each sequence's tokens are contiguous (managers/schedule_batch.py), so there are at most
    `num_seqs` runs, and with `max_chunks` at most `max_lora_runs` (decode rows grouped by slot, then the chunks);
    a run meets one tile more than the tile boundaries it crosses, and each of the T / tile_rows - 1 boundaries is
    crossed by one run at most: at most T / tile_rows + runs - 1 entries. Every layer gathers the shrink's output
    into this table's [entries, tile_rows] layout, so the tighter bound makes that gather smaller (751 decode rows
    of 32 adapters in the 1024 bucket: 1.4% of the forward on an H100, docs/benchmarks.md)."""
    runs = num_seqs if max_chunks is None else min(num_seqs, max_lora_runs(lora.slot_scale.shape[0], max_chunks))
    max_entries = lora.token_slot.shape[0] // tile_rows + runs - 1
    return build_entry_table(lora.token_slot, lora.slot_scale, tile_m=tile_rows, max_entries=max_entries)


def prepare_on_host(lora: LoRABatch, block_rows: int) -> PallasGPUMeta:
    """The work list of `prepare` for row tiles of `block_rows`, built with numpy from a host LoRABatch (same
    values; tests and benchmarks)."""
    seg_start, seg_slot, slot_rank = (np.asarray(a) for a in (lora.seg_start, lora.seg_slot, lora.slot_rank))
    work = make_work_list_host(seg_start, seg_slot, slot_rank, lora.token_slot.shape[0], block_rows)
    work_perm = padded_perm(np.asarray(lora.sort_perm), block_rows)
    return PallasGPUMeta(lora, work=work, work_perm=work_perm, work_block_rows=block_rows)


def is_gate_up(num_parts: int, row_parallel: bool) -> bool:
    """Whether a LoRA module is the MLP's gate|up: the column-parallel module of two packed parts."""
    return num_parts == 2 and not row_parallel


def _first_device(mesh: Mesh | None):
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def _is_hopper(mesh: Mesh | None) -> bool:
    """Whether the devices are CUDA GPUs of compute capability 9.x (WGMMA and TMA: the Mosaic GPU GEMM)."""
    return is_hopper(_first_device(mesh))


def _work(meta: LoRAMeta, block_rows: int) -> tuple:
    """The step's precomputed (work list, padded perm) when built for these row tiles, else (None, None)."""
    if isinstance(meta, PallasGPUMeta) and meta.work is not None and meta.work_block_rows == block_rows:
        return meta.work, meta.work_perm
    return None, None


def _segments(meta: LoRAMeta) -> tuple[jax.Array, ...]:
    lora = meta.batch
    return (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)


class PallasGPUBackend(PallasBackend):
    native_platforms = ("gpu", "cuda")
    # token buckets from this many tokens run gate|up's GEMM with the LoRA inside it on Hopper GPUs by default; the
    # SGMV kernels beside the base GEMM below. With 32 adapters the SGMV path was faster at 369 and 512 decode rows in
    # the 512 bucket, the fused GEMM in 2048- and 4096-token prefill steps
    # (docs/benchmarks.md "The LoRA expand beside the base GEMM")
    FUSED_GEMM_MIN_TOKENS = 1024
    # ... and q|k|v's, o's and down's from this many: in the 1024 bucket, 32 adapters' decode steps of 643-881 rows
    # ran 1.2-4.9% faster on an H100 with gate|up alone fused than with every module (0.6% slower at 1000 rows),
    # 1024-token prefill steps of 4 and 8 prompts 1.6-3.6% slower, and the bucket holds decode steps far more often
    # (docs/benchmarks.md "The 1024 bucket on an H100: fused GEMM or SGMV kernels, and the gated epilogue")
    FUSED_GEMM_OTHER_MIN_TOKENS = 2048
    # gate|up with the activation in the fused kernel from this bucket on (on an H200 with 32 adapters: 0.96 of the
    # packed kernel + XLA's activation at 4,096 tokens, 1.04 at 512 decode rows; docs/benchmarks.md)
    GATED_MIN_TOKENS = 2048
    # token buckets up to this many tokens (decode rows: a row tile holds one entry per adapter run, dozens with many
    # adapters) fetch ENTRY_SLOTS LoRA entries ahead in the fused GEMM (pallas_kernels/sgmv/gemm_lora_gpu.py), the
    # gated kernel too where it runs in such a bucket
    ENTRY_RING_MAX_TOKENS = 1024
    ENTRY_SLOTS = 2
    # q|k|v's (and, where it takes the SGMV path with a delta, gate|up's) shrink before its base GEMM in the program's
    # order (`delta_holding_input`): 1.1-1.2% off a 147-row forward on an H200, the same on an H100 (docs/lora_backends.md)
    shrink_first = True

    def __init__(
        self,
        mesh: Mesh | None = None,
        interpret: bool | None = None,
        fused_gemm_min_tokens: int | None = None,
        fused_gemm_split_k: bool = True,
        fused_gemm_other_min_tokens: int | None = None,
        gated_delta: bool | None = None,
    ):
        """fused_gemm_min_tokens: the least token bucket that runs gate|up's base GEMM with the LoRA inside it (0:
        none), and every other module's when fused_gemm_other_min_tokens is None. Default: FUSED_GEMM_MIN_TOKENS for
        gate|up and FUSED_GEMM_OTHER_MIN_TOKENS for the others on Hopper GPUs, 0 elsewhere; given elsewhere (CPU
        tests), that path computes with the kernel's pure-JAX reference. fused_gemm_split_k: that kernel cuts its K
        loop where its tiles leave SMs idle (`choose_gemm_lora_split`); False keeps one part
        (scripts/bench_gemm_lora.py compares the two). fused_gemm_other_min_tokens: q|k|v's, o's and down's
        threshold, where it differs (tests of the default rule on CPU). gated_delta: whether gate|up hands its delta
        to the base GEMM kernel's gated epilogue below the fused GEMM's buckets (`gives_packed_delta`; default: on
        Hopper GPUs; elsewhere the base GEMM's reference then adds it, CPU tests)."""
        super().__init__(mesh, interpret)
        has_gemm_kernel = not self.interpret and _is_hopper(mesh)
        if fused_gemm_min_tokens is None:
            fused_gemm_min_tokens = self.FUSED_GEMM_MIN_TOKENS if has_gemm_kernel else 0
            if fused_gemm_other_min_tokens is None:
                fused_gemm_other_min_tokens = self.FUSED_GEMM_OTHER_MIN_TOKENS if has_gemm_kernel else 0
        self.fused_gemm_min_tokens = fused_gemm_min_tokens
        self.fused_gemm_other_min_tokens = (
            fused_gemm_min_tokens if fused_gemm_other_min_tokens is None else fused_gemm_other_min_tokens
        )
        self.gated_delta = has_gemm_kernel if gated_delta is None else gated_delta
        self.fused_gemm_reference = not has_gemm_kernel
        self.fused_gemm_sms = _first_device(mesh).core_count if has_gemm_kernel and fused_gemm_split_k else 0

    def prepare(self, lora: LoRABatch, num_seqs: int, max_chunks: int | None = None) -> PallasGPUMeta:
        num_tokens = lora.token_slot.shape[0]
        block_rows = gpu_block_rows(num_tokens)
        work = make_work_list(lora.seg_start, lora.seg_slot, lora.slot_rank, num_tokens, block_rows)
        work_perm = padded_perm(lora.sort_perm, block_rows, jnp)
        tile_rows = self.fused_gemm_tile_rows(num_tokens, lora.num_segments)
        entries = entry_table(lora, tile_rows, num_seqs, max_chunks) if tile_rows else None
        return PallasGPUMeta(lora, work=work, work_perm=work_perm, work_block_rows=block_rows, entries=entries)

    def returns_delta(self, input_sharded: bool) -> bool:
        """Column-parallel modules (q|k|v, gate|up): the expand then needs only the shrink's output, not the base
        GEMM's, so on a GPU it runs beside the GEMM (concurrent kernel scheduling) and XLA folds the add into the ops
        that read the output (the sum of the GEMM's split-K parts, gate|up's activation); in place it would wait for
        the GEMM and add a pass over its output. Row-parallel modules add into the residual (LoRALinear), which also
        lets their expand run beside the GEMM (docs/lora_backends.md "Delta or in place")."""
        return not input_sharded

    def fits_stacks(self, buffers: tuple[LayerStack, ...]) -> bool:
        """Whether the Triton kernels' int32 offsets reach every layer of these stacks."""
        return all(fits_stacked_offsets(w.stack.shape) for w in buffers)

    def fused_gemm_tile_rows(self, num_tokens: int, num_segments: int) -> int:
        """The row tile of the entry table where any module may run the GEMM with the LoRA inside it."""
        tile_m = GemmLoraTiles.tile_m
        thresholds = [t for t in (self.fused_gemm_min_tokens, self.fused_gemm_other_min_tokens) if t > 0]
        return tile_m if thresholds and min(thresholds) <= num_tokens and num_tokens % tile_m == 0 else 0

    def takes_fused_gemm(self, num_tokens: int, num_parts: int, row_parallel: bool) -> bool:
        """Whether a module of `num_parts` packed parts takes the GEMM with the LoRA inside it in a bucket of
        num_tokens tokens: gate|up (column-parallel, two parts) from fused_gemm_min_tokens, every other module from
        fused_gemm_other_min_tokens (0: never)."""
        least = self.fused_gemm_min_tokens if is_gate_up(num_parts, row_parallel) else self.fused_gemm_other_min_tokens
        return 0 < least <= num_tokens

    def gives_packed_delta(self, num_tokens: int) -> bool:
        """gate|up's delta goes to the base GEMM kernel's gated epilogue in buckets where gate|up does not take the
        fused GEMM, when `gated_delta` is on."""
        return self.gated_delta and not self.takes_fused_gemm(num_tokens, 2, row_parallel=False)

    # -- per-shard kernels -----------------------------------------------------------------------------------

    def _local_shrink_partials(
        self, x: jax.Array, lora_a: jax.Array, meta: LoRAMeta, rank_block: int | None, layer: jax.Array | None = None
    ) -> jax.Array:
        tiles = choose_tiles(x.shape[0], meta.batch.num_segments, x.shape[1], None, shrink_rank=lora_a.shape[-2])
        return sgmv_shrink_gpu_partials(
            x,
            lora_a,
            *_segments(meta),
            *_work(meta, tiles.block_rows),
            layer,
            tiles=tiles,
            rank_block=rank_block,
            interpret=self.interpret,
        )

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
        """One launch for every part."""
        tiles = choose_tiles(s.shape[-2], meta.batch.num_segments, None, tuple(b.shape[-2] for b in lora_bs))
        return sgmv_expand_gpu(
            s,
            lora_bs,
            *_segments(meta),
            scale,
            base_out,
            *_work(meta, tiles.block_rows),
            layer,
            out_dtype=out_dtype,
            tiles=tiles,
            interpret=self.interpret,
        )

    # -- the base GEMM with the LoRA inside it (prefill) ---------------------------------------------------------

    def _fused_gemm_tiles(
        self,
        x: jax.Array,
        in_local: int,
        widths_local: tuple[int, ...],
        rank: int,
        meta: LoRAMeta,
        gated: bool,
        row_parallel: bool,
    ) -> tuple[GemmLoraTiles, int] | None:
        """The kernel's tiles and K parts (`choose_gemm_lora_split` over this GPU's SMs; one part off GPUs, and
        for the gated kernel) when this module takes the fused GEMM in this bucket (`takes_fused_gemm`) and fits it,
        else None."""
        if not meta.runs_base_gemm or x.dtype != jnp.bfloat16 or (gated and x.shape[0] < self.GATED_MIN_TOKENS):
            return None
        if not self.takes_fused_gemm(x.shape[0], len(widths_local), row_parallel):
            return None
        slots = self.ENTRY_SLOTS if x.shape[0] <= self.ENTRY_RING_MAX_TOKENS else 1
        try:
            if gated:
                tiles, k_splits = choose_gemm_lora_tiles(rank, gated=True, entry_slots=slots), 1
            else:
                num_sms = self.fused_gemm_sms
                tiles, k_splits = choose_gemm_lora_split(x.shape[0], in_local, sum(widths_local), rank, num_sms, slots)
            check_gemm_lora_shapes(x.shape[0], in_local, widths_local, rank, tiles, gated)
        except ValueError:
            return None
        return (tiles, k_splits) if meta.entries.tile_m == tiles.tile_m else None

    def apply_with_base(
        self,
        x: jax.Array,
        kernel: jax.Array | LayerStack,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
        num_rows: jax.Array | None = None,
        gated: bool = False,
        zero_padding: bool = True,
    ) -> jax.Array | None:
        """The SGMV shrink kernel, then pallas_kernels/sgmv/gemm_lora_gpu.py: x @ W with each part's expand added
        into the GEMM's accumulator, the padding's row tiles after `num_rows` skipped (zero, or any values with
        zero_padding=False). Row-parallel layers (`input_sharded` over several devices) add the delta on the first
        shard only, before the all-reduce of the partial outputs. gated (gate|up, column-parallel): the kernel
        applies the MLP's activation in its epilogue and returns silu(gate) * up, each shard its columns of it."""
        if gated and not is_gate_up(len(lora_bs), input_sharded):
            raise ValueError("apply_with_base: gated is for a column-parallel module of two parts, gate and up")
        rank = layer_shape(lora_bs[0])[-1]
        in_local = layer_shape(kernel)[-2] // (tp_size if input_sharded else 1)
        widths_local = tuple(layer_shape(b)[-2] // (tp_size if output_sharded else 1) for b in lora_bs)
        chosen = self._fused_gemm_tiles(x, in_local, widths_local, rank, meta, gated, input_sharded)
        if chosen is None:
            return None
        tiles, k_splits = chosen
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

        def local(x, w, lora_a, meta, scalars, *lora_bs):
            layer, a_layer, rows = scalars[0], scalars[1], scalars[2:]
            s = self._local_shrink_partials(x, lora_a, meta, rank, a_layer).sum(0)
            table = meta.entries
            if is_split:
                s = jax.lax.psum(s, TENSOR_AXIS)
                is_first = jax.lax.axis_index(TENSOR_AXIS) == 0
                table = dataclasses.replace(table, entry_start=jnp.where(is_first, table.entry_start, 0))
            options = dict(tiles=tiles, k_splits=k_splits, gated=gated, reference=self.fused_gemm_reference)
            y = gemm_lora_gpu(x, w, s, table, lora_bs, layer, rows, zero_padding=zero_padding, **options)
            return jax.lax.psum(y, TENSOR_AXIS) if is_split else y

        x_spec, a_spec = (IN_SPLIT_X, IN_SPLIT_A) if input_sharded else (REPLICATED, REPLICATED)
        w_spec = _IN_SPLIT_W if input_sharded else _OUT_SPLIT_W if output_sharded else REPLICATED
        b_spec, y_spec = (OUT_SPLIT_B, OUT_SPLIT_Y) if output_sharded else (REPLICATED, REPLICATED)
        specs = (x_spec, stacked_spec(w_spec, True), stacked_spec(a_spec, True), REPLICATED, REPLICATED)
        specs += (stacked_spec(b_spec, True),) * len(lora_bs)
        rows = rows_operand(num_rows, x.shape[0]).astype(jnp.int32)
        scalars = jnp.concatenate([jnp.stack([layer, a_layer]).astype(jnp.int32), rows])
        return self._sharded(local, specs, y_spec)(x, stacks[0], a_stack, meta, scalars, *stacks[1:])
