"""The LoRA compute backend interface, its per-step metadata and its factory
(`--lora-backend einsum|bgmv|sgmv|pallas|auto`).

Where it sits: the model's forward calls its backend's `prepare` once per step (inside the jitted forward,
before the layer scan), which turns the step's plain `LoRABatch` into the backend's own metadata pytree, a
`LoRAMeta` or a subclass of it (the Pallas GPU backend adds its kernels' work list and, in prefill, the entry
table of the GEMM with the LoRA inside it). Every `LoRALinear` then hands that metadata back with its layer's
base output and A/B buffers to `apply_packed`, or, where `LoRAMeta.runs_base_gemm`, first to `apply_with_base`;
gate|up asks `packed_delta` for its delta alone where the base GEMM kernel applies the activation.
The model never sees what the metadata holds.

What exists here: `LoRAMeta`, `LoRABackend` (the interface: `prepare`, `apply_packed`, `apply_with_base`,
`packed_delta`),
`dot_precision`, `BACKEND_NAMES` and `make_lora_backend`. The pure-JAX backends share `XlaBackend`
(lora/backend/xla.py), the Pallas ones `PallasBackend` (lora/backend/pallas.py).

Shapes: x [T, in]; lora_a [A, P * R, in] (P packed parts stacked along the rank axis); each lora_b
[A, out_p, R]; or LayerStack views of the model's [L, ...] stacks (layers/layer_stack.py): backends that read
stacks in place (`reads_stacked`) take them as they are, the others slice the layer. Slot 0 is the base model
(all-zero weights), so base tokens get an exactly-zero delta. Sharding (mesh axes ("data", "tensor")):
column-parallel layers pass `output_sharded=True` (B split on `out`); row-parallel layers pass
`input_sharded=True` (x and A split on `in`, the [T, R] shrink output all-reduced, B replicated).
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.lora.lora_batch import LoRABatch

TENSOR_AXIS = "tensor"


@dataclasses.dataclass(frozen=True)
class LoRAMeta:
    """A backend's per-step metadata: the step's LoRABatch, plus what a subclass adds for its kernels."""

    batch: LoRABatch

    @property
    def runs_base_gemm(self) -> bool:
        """Whether the layers hand the backend their base weight (`apply_with_base`) this step."""
        return False


jax.tree_util.register_dataclass(LoRAMeta, data_fields=["batch"], meta_fields=[])


def dot_precision(*dtypes: jnp.dtype) -> jax.lax.Precision | None:
    """Full float32 precision when every operand is f32 (GPUs would otherwise use tf32)."""
    return jax.lax.Precision.HIGHEST if all(jnp.dtype(d) == jnp.float32 for d in dtypes) else None


class LoRABackend(abc.ABC):
    """One way to compute the LoRA delta of a batch that mixes adapters."""

    name: str = "base"
    # whether apply_packed / apply_with_base read LayerStack views in place (else they slice the layer)
    reads_stacked: bool = False

    def __init__(self, mesh: Mesh | None = None):
        self.mesh = mesh

    def prepare(self, lora: LoRABatch, num_seqs: int, max_chunks: int | None = None) -> LoRAMeta:
        """The backend's metadata for this step, built once per forward inside jit and shared by every layer.

        num_seqs: the step's static sequence bucket (each sequence's tokens are contiguous). max_chunks: the most
        prefill chunks a step holds (--max-prefill-seqs; None: any); the scheduler groups a step's decode rows by
        adapter slot before its chunks, so the runs of one adapter's tokens are then at most the adapter slots plus
        max_chunks (`max_lora_runs`, which `build_lora_batch` checks on the host)."""
        return LoRAMeta(lora)

    @abc.abstractmethod
    def apply_packed(
        self,
        x: jax.Array,  # [T, in]
        lora_a: jax.Array | LayerStack,  # [A, P * R, in]: the P parts' A stacked along the rank axis
        lora_bs: tuple[jax.Array | LayerStack, ...],  # P x [A, out_p, R]
        meta: LoRAMeta,
        base_out: jax.Array,  # [T, sum out_p], parts packed shard-major over tp_size shards (layers/linear.py)
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array:
        """base_out + the LoRA delta of every part, in base_out's packed layout and dtype.

        base_out is what the delta is added into: the layer's base output, or (row-parallel layers) the
        residual stream, which LoRALinear adds the base output to afterwards."""

    def apply_with_base(
        self,
        x: jax.Array,  # [T, in]
        kernel: jax.Array | LayerStack,  # [in, sum out_p] base weight, packed shard-major (layers/linear.py)
        lora_a: jax.Array | LayerStack,  # [A, P * R, in]
        lora_bs: tuple[jax.Array | LayerStack, ...],  # P x [A, out_p, R]
        meta: LoRAMeta,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
        num_rows: jax.Array | None = None,
        gated: bool = False,
        zero_padding: bool = True,
    ) -> jax.Array | None:
        """x @ kernel plus every part's LoRA delta, from one GEMM kernel (no bias), in the packed layout; None
        when this module does not fit that kernel (or the step's metadata has no `runs_base_gemm`), and
        LoRALinear then runs the base GEMM and `apply_packed`. num_rows ([1] i32): the step's real tokens; the
        kernel may skip the padding's row tiles after them (their outputs then zero). None: every row.
        zero_padding=False (not gated): those rows may hold any values instead (no select zeroes them), for a
        consumer that masks them itself. gated (a column-parallel [gate | up] module): silu(gate) * up [T, out / 2]
        from the kernel's epilogue instead (the rows after num_rows' row tile zero, those inside it any values), or
        None."""
        return None

    def packed_delta(
        self,
        x: jax.Array,  # [T, in]
        lora_a: jax.Array | LayerStack,  # [A, P * R, in]
        lora_bs: tuple[jax.Array | LayerStack, ...],  # P x [A, out_p, R]
        meta: LoRAMeta,
        *,
        tp_size: int,
    ) -> jax.Array | None:
        """A column-parallel module's LoRA delta alone, [T, sum out_p] in x's dtype and the packed layout (each
        device its columns), for a base GEMM kernel to add in its epilogue (LoRALinear.silu_and_mul: gate|up's,
        before the activation); None where this backend does not hand it over in this bucket, and LoRALinear then
        adds the delta to the packed product (`apply_packed`) before the activation."""
        return None

    def delta_holding_input(
        self,
        x: jax.Array,  # [T, in]
        lora_a: jax.Array | LayerStack,  # [A, P * R, in]
        lora_bs: tuple[jax.Array | LayerStack, ...],  # P x [A, out_p, R]
        meta: LoRAMeta,
        *,
        tp_size: int,
    ) -> tuple[jax.Array, jax.Array] | None:
        """(a column-parallel module's delta as `packed_delta`'s, x held behind its shrink): the base GEMM that
        reads the held x starts only once the shrink has run, so the shrink does not wait for the GEMM's tiles to
        drain and the expand runs beside the GEMM (LoRALinear adds the delta to the GEMM's output). None where this
        backend does not order a module that way, and LoRALinear runs the base GEMM, then `apply_packed`."""
        return None


BACKEND_NAMES = ("einsum", "bgmv", "sgmv", "pallas", "auto")


def make_lora_backend(name: str, mesh: Mesh | None = None, fused_gemm_min_tokens: int | None = None) -> LoRABackend:
    """Backend for `--lora-backend NAME` over `mesh` (None: single device). fused_gemm_min_tokens is
    `--lora-fused-gemm-min-tokens`, for the backends that run the Pallas kernels (pallas, auto). "pallas" is the
    platform's Pallas backend (PallasTPUBackend on TPU, PallasGPUBackend elsewhere)."""
    from sgl_jax_lora.lora.backend.auto import AutoBackend
    from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
    from sgl_jax_lora.lora.backend.einsum import EinsumBackend
    from sgl_jax_lora.lora.backend.pallas import make_pallas_backend
    from sgl_jax_lora.lora.backend.sgmv import SgmvBackend

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown --lora-backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "pallas":
        return make_pallas_backend(mesh, fused_gemm_min_tokens=fused_gemm_min_tokens)
    if name == "auto":
        return AutoBackend(mesh, fused_gemm_min_tokens=fused_gemm_min_tokens)
    return {"einsum": EinsumBackend, "bgmv": BgmvBackend, "sgmv": SgmvBackend}[name](mesh=mesh)
