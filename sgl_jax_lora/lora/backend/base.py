"""The LoRA compute backend interface and its factory (`--lora-backend einsum|bgmv|sgmv|pallas|auto`).

Where it sits: every `LoRALinear` holds one backend and calls `apply_packed` with its layer's base output,
A/B buffers and the step's `LoRABatch`. Packed modules (q|k|v, gate|up) shrink once on the stacked A and
expand once per part; the default `apply_packed` composes `shrink` and `expand` in XLA, and a backend with
kernels may fuse more (the Pallas GPU backend adds each part's delta into the packed output in place). In
prefill a backend may also take the base weight and compute the base GEMM and the delta in one kernel
(`fused_gemm_tile_rows`, `apply_with_base`: the Pallas backend on Hopper GPUs).

Shapes: x [T, in]; lora_a [A, R, in]; lora_b [A, out, R]; s [T, R] float32. Slot 0 is the base model
(all-zero weights), so base tokens get an exactly-zero delta. Sharding (mesh axes ("data", "tensor")):
column-parallel layers pass `output_sharded=True` (B split on `out`); row-parallel layers pass
`input_sharded=True` (x and A split on `in`, the [T, R] shrink output all-reduced, B replicated).
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.linear import pack_parts
from sgl_jax_lora.lora.layer_stack import LayerStack
from sgl_jax_lora.lora.lora_batch import LoRABatch

TENSOR_AXIS = "tensor"


def dot_precision(*dtypes: jnp.dtype) -> jax.lax.Precision | None:
    """Full float32 precision when every operand is f32 (GPUs would otherwise use tf32)."""
    return jax.lax.Precision.HIGHEST if all(jnp.dtype(d) == jnp.float32 for d in dtypes) else None


class LoRABackend(abc.ABC):
    """One way to compute the LoRA delta of a batch that mixes adapters."""

    name: str = "base"

    def __init__(self, mesh: Mesh | None = None):
        self.mesh = mesh

    @abc.abstractmethod
    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        """x [T, in], lora_a [A, R, in] -> [T, R] float32, x_t @ A[slot_t].T.

        input_sharded: x and A split on `in` over 'tensor' (row-parallel layer); the partial [T, R] sums
        are all-reduced, the only collective.
        rank_block: A's rows come in blocks of this many (R for one module; the per-part R when packed
        q|k|v or gate|up stack their A along R). Given it, kernels may skip rows at or above a slot's rank
        within each block; None lets them skip only base (rank-0) slots. Results are the same either way
        when rows above each rank are zero, as the memory pool guarantees.
        """

    @abc.abstractmethod
    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        """s [T, R] float32, lora_b [A, out, R] -> [T, out] out_dtype, s_t @ B[slot_t].T.

        output_sharded: B split on `out` over 'tensor' (column-parallel layer); the result is split likewise.
        """

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
        """[T, out]: expand(shrink(x) * slot_scale[token_slot], B), in x.dtype.

        With base_out, returns base_out + delta in base_out.dtype; backends that can fuse the add do.
        """
        s = self.shrink(x, lora_a, lora, input_sharded=input_sharded, rank_block=lora_a.shape[1])
        s = s * lora.slot_scale[lora.token_slot][:, None]
        delta = self.expand(s, lora_b, lora, output_sharded=output_sharded, out_dtype=x.dtype)
        if base_out is None:
            return delta
        return (base_out.astype(jnp.float32) + delta.astype(jnp.float32)).astype(base_out.dtype)

    def reads_stacked(self, num_tokens: int, num_segments: int, out_features: int = 0) -> bool:
        """Whether `apply_packed` takes layer-stacked buffers (LayerStack views, lora/layer_stack.py) for a
        (token bucket, segment bucket) and a module of `out_features` output columns (all parts), and reads
        its layer in place; False: it gets one layer's [A, ...] slice."""
        return False

    def work_block_rows(self, num_tokens: int, num_segments: int) -> int:
        """Row tile of the kernel work list this backend reads from `LoRABatch.work` for a (token bucket,
        segment bucket); 0 = it reads none, so the engine does not build one (it costs host time every step)."""
        return 0

    def fused_gemm_tile_rows(self, num_tokens: int, num_segments: int) -> int:
        """Row tile of the GEMM with the LoRA inside it (`apply_with_base`) when this backend runs it for a
        (token bucket, segment bucket) of prefill; 0 = never. Given one, the model builds the batch's entry
        table once per forward (`LoRABatch.entries`) and hands every LoRALinear its base weight as a LayerStack
        view, so that the kernel reads the layer's W in place."""
        return 0

    def apply_with_base(
        self,
        x: jax.Array,  # [T, in]
        kernel: jax.Array | LayerStack,  # [in, sum out_p] base weight, packed shard-major (layers/linear.py)
        lora_a: jax.Array | LayerStack,  # [A, P * R, in]
        lora_bs: tuple[jax.Array | LayerStack, ...],  # P x [A, out_p, R]
        lora: LoRABatch,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array | None:
        """x @ kernel plus every part's LoRA delta, from one GEMM kernel (no bias), in the packed layout; None
        when this module does not fit that kernel, and LoRALinear then runs the base GEMM and `apply_packed`."""
        return None

    def apply_packed(
        self,
        x: jax.Array,  # [T, in]
        lora_a: jax.Array,  # [A, P * R, in]: the P parts' A stacked along the rank axis
        lora_bs: tuple[jax.Array, ...],  # P x [A, out_p, R]
        lora: LoRABatch,
        base_out: jax.Array,  # [T, sum out_p], parts packed shard-major over tp_size shards (layers/linear.py)
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array:
        """base_out + the LoRA delta of every part, in base_out's packed layout and dtype.

        base_out is what the delta is added into: the layer's base output, or (row-parallel layers) the
        residual stream, which LoRALinear adds the base output to afterwards."""
        max_rank = lora_bs[0].shape[2]
        shrunk = self.shrink(x, lora_a, lora, input_sharded=input_sharded, rank_block=max_rank)
        shrunk = shrunk * lora.slot_scale[lora.token_slot][:, None]
        deltas = [
            self.expand(
                shrunk[:, i * max_rank : (i + 1) * max_rank],
                part_b,
                lora,
                output_sharded=output_sharded,
                out_dtype=x.dtype,
            )
            for i, part_b in enumerate(lora_bs)
        ]
        delta = deltas[0] if len(deltas) == 1 else pack_parts(deltas, tp_size)
        return base_out + delta

    def constrain(self, value: jax.Array, spec: P) -> jax.Array:
        """Pins a pure-JAX result's sharding (GSPMD) when the backend has a multi-device mesh with Auto axes
        (explicit-sharding meshes carry the sharding in the types already)."""
        if self.mesh is None or self.mesh.size == 1:
            return value
        if any(t != jax.sharding.AxisType.Auto for t in self.mesh.axis_types):
            return value
        return jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, spec))


def shrink_out_spec() -> P:
    return P()  # the [T, R] shrink result is small and replicated (all-reduced when input_sharded)


def expand_out_spec(output_sharded: bool) -> P:
    return P(None, TENSOR_AXIS) if output_sharded else P()


BACKEND_NAMES = ("einsum", "bgmv", "sgmv", "pallas", "auto")


def make_lora_backend(name: str, mesh: Mesh | None = None, fused_gemm_min_tokens: int | None = None) -> LoRABackend:
    """Backend for `--lora-backend NAME` over `mesh` (None: single device). fused_gemm_min_tokens is
    `--lora-fused-gemm-min-tokens`, for the backends that run the Pallas kernels (pallas, auto)."""
    from sgl_jax_lora.lora.backend.auto import AutoBackend
    from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
    from sgl_jax_lora.lora.backend.einsum import EinsumBackend
    from sgl_jax_lora.lora.backend.pallas import PallasBackend
    from sgl_jax_lora.lora.backend.sgmv import SgmvBackend

    classes = {
        "einsum": EinsumBackend,
        "bgmv": BgmvBackend,
        "sgmv": SgmvBackend,
        "pallas": PallasBackend,
        "auto": AutoBackend,
    }
    if name not in classes:
        raise ValueError(f"unknown --lora-backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name in ("pallas", "auto"):
        return classes[name](mesh=mesh, fused_gemm_min_tokens=fused_gemm_min_tokens)
    return classes[name](mesh=mesh)
