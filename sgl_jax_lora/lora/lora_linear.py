"""LoRALinear: a base Linear plus the device buffers of every adapter slot for that layer.

Flow: the model builds LoRALinear in place of Linear for each LoRA target in its table
(lora/target_shapes.py LORA_TARGETS) when LoRA is enabled. LoRAMemoryPool writes adapters into slot s of the
buffers (a donated, shape-stable update). At run time:

    y = base(x) + expand(shrink(x, A) * slot_scale[token_slot], B_part) for each packed part
      (backend.apply_packed: one shrink on the stacked A, one expand per part into the packed output)

with the step's backend metadata (`LoRAMeta`, built once per forward by the backend's `prepare`). When that
metadata says the backend runs the base GEMM with the LoRA inside it (`runs_base_gemm`: the Pallas GPU backend
in large buckets on Hopper GPUs), y = that one kernel's output instead (`apply_with_base`), for every module that
fits it and that the backend takes in this bucket (`PallasGPUBackend.takes_fused_gemm`); for gate|up
(`silu_and_mul`) that kernel also applies the MLP's activation in its epilogue. In buckets that run the base GEMM
kernel without it, gate|up's delta alone (`backend.packed_delta`, where the backend hands it over) goes into the
base GEMM kernel's gated epilogue, added before the activation. Where it does
not (and in steps without adapter tokens, and with an 8-bit base weight, `--quantization fp8`), the base GEMM is
`Linear.base`: in buckets from `--gpu-gemm-min-tokens` tokens the base GEMM kernel of layers/base_gemm.py, with fp8
layers/fp8.py's, else XLA's dot.

The row-parallel layers (o_proj, down_proj) are called with the residual stream and return
`(residual + delta) + base(x)`: the delta goes into the residual, so the LoRA kernels do not wait for the
base GEMM (docs/architecture.md "GPU kernel scheduling"). A column-parallel layer whose backend orders its shrink
first (`delta_holding_input`) runs the base GEMM on x held behind the shrink and adds the delta to its output.

Inside the model's layer loop the buffers arrive as LayerStack views of the [L, ...] stacks
(layers/layer_stack.py) and go to the backend as they are: backends that read stacks in place do, the others
take one layer's slice.

Buffers (A = slots incl. slot 0 = base, R = max rank, rows above an adapter's rank are zero):
    lora_a            [A, P*R, in]   P packed parts stacked along the rank axis (q|k|v or gate|up)
    lora_b[_<part>]   [A, out_p, R]  one per part, in the part's own output layout
Their logical axes (for layers/sharding.py) follow the base linear's LinearAxes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax_lora.layers.base_gemm import BaseGemm, base_gemm, fits_base_gemm
from sgl_jax_lora.layers.fp8 import Fp8Gemm
from sgl_jax_lora.layers.linear import BaseKernel, Linear, LinearAxes

if TYPE_CHECKING:  # type only: the model receives a backend object built by lora_setup.py
    from sgl_jax_lora.lora.backend.base import LoRABackend, LoRAMeta


class LoRAWeight(nnx.Variable):
    """Adapter buffers: device state written by the memory pool, never trained."""


class LoRABaseKernel(BaseKernel):
    """The base weight of a LoRALinear. In token buckets that run the GEMM with the LoRA inside it, the model
    hands it over as a LayerStack view of the [L, in, out] stack, as it does the LoRA buffers, so that the
    kernel reads the layer in place (a kernel's operand sliced outside it would be a copy of the layer's W); so it
    does every BaseKernel in buckets that run the base GEMM kernel (layers/base_gemm.py)."""


@dataclasses.dataclass(frozen=True)
class LoRAModelSpec:
    """What the model needs to allocate and run LoRA layers."""

    num_slots: int  # A: device slots including slot 0 (base)
    max_rank: int  # R
    backend: LoRABackend
    target_modules: frozenset[str]  # packed module names that get buffers, e.g. {"qkv_proj", "o_proj"}


class LoRALinear(Linear):
    def __init__(
        self,
        in_features: int,
        part_sizes: tuple[int, ...],
        part_names: tuple[str, ...],
        tp_size: int,
        use_bias: bool,
        dtype: jnp.dtype,
        spec: LoRAModelSpec,
        row_parallel: bool,
        axes: LinearAxes,
        base_gemm: BaseGemm | None = None,
        fp8: Fp8Gemm | None = None,
    ):
        super().__init__(in_features, part_sizes, tp_size, use_bias, dtype, axes, base_gemm, fp8)
        if fp8 is None:  # an 8-bit base weight stays an Fp8Kernel: the GEMM with the LoRA inside it is 16-bit only
            self.kernel = LoRABaseKernel(self.kernel.get_value(), logical_axes=(axes.in_axis, axes.out_axis))
        self.part_names = part_names
        self.row_parallel = row_parallel
        self.backend = spec.backend
        self.max_rank = spec.max_rank
        num_parts = len(part_sizes)
        # A follows the base weight's input axis (split in row-parallel layers), each B its part's output axis
        # (split in column-parallel layers); slots and rank are never split
        self.lora_a = LoRAWeight(
            jnp.zeros((spec.num_slots, num_parts * spec.max_rank, in_features), dtype),
            logical_axes=("lora_slots", "lora_rank", axes.in_axis),
        )
        for name, size, part_axis in zip(part_names, part_sizes, axes.part_axes):
            b = jnp.zeros((spec.num_slots, size, spec.max_rank), dtype)
            setattr(self, lora_b_name(name), LoRAWeight(b, logical_axes=("lora_slots", part_axis, "lora_rank")))

    def __call__(
        self,
        x: jax.Array,
        lora: LoRAMeta | None = None,
        residual: jax.Array | None = None,
        num_rows: jax.Array | None = None,
        zero_padding: bool = True,
    ) -> jax.Array:
        """x [T, in] -> [T, out] packed (+ residual [T, out]); the LoRA delta is exactly zero for slot-0 tokens.
        num_rows: the step's real tokens, as in `Linear.base` (the GEMM kernels skip the padding after them).
        zero_padding=False: the rows from num_rows[0] on may hold any values (neither the base GEMM kernel nor the
        GEMM with the LoRA inside it zeroes them; the delta added to them is the padding tokens' own), for a
        consumer that masks them itself (models/llama.py: q|k|v into the rotary + K/V write kernel).

        With `residual`, the delta is added into the residual rather than into the base output, and the
        base output is added last: the LoRA kernels then need only x and the residual, not the base GEMM's
        result, so on GPU they run beside the GEMM instead of after it (concurrent kernel scheduling).
        """
        if lora is None:
            return super().__call__(x, residual=residual, num_rows=num_rows, zero_padding=zero_padding)
        # base GEMM and LoRA in one kernel, where the module fits it
        y = self._with_base(x, lora, num_rows, zero_padding=zero_padding)
        if y is not None:
            y = y if self.bias is None else y + self.bias[...]
            return y if residual is None else residual + y
        if residual is None and not self.row_parallel:  # the shrink first, the expand beside the base GEMM
            held = self.backend.delta_holding_input(
                x, self.lora_a.get_value(), self._lora_bs(), lora, tp_size=self.tp_size
            )
            if held is not None:
                delta, x_held = held
                return self.base(x_held, num_rows, zero_padding) + delta
        y = self.base(x, num_rows, zero_padding)
        target = y if residual is None else residual
        out = self.backend.apply_packed(
            x,
            self.lora_a.get_value(),
            self._lora_bs(),
            lora,
            target,
            tp_size=self.tp_size,
            input_sharded=self.row_parallel,
            output_sharded=not self.row_parallel,
        )
        return out if residual is None else out + y

    def silu_and_mul(self, x: jax.Array, lora: LoRAMeta | None = None, num_rows: jax.Array | None = None) -> jax.Array:
        """`Linear.silu_and_mul` with this module's adapters. In steps where no token uses an adapter (lora None),
        the base GEMM kernel's epilogue applies it; where the backend runs the GEMM with the LoRA inside it
        (`runs_base_gemm`) and the module fits, that kernel's epilogue, after the entries; where the base GEMM
        kernel runs the module and the backend hands over the delta, the base kernel's epilogue after adding it
        (`_gated_with_delta`); else the packed product with the LoRA delta, split, then the activation."""
        if lora is None:
            return super().silu_and_mul(x, None, num_rows)
        y = self._with_base(x, lora, num_rows, gated=True) if self.bias is None else None
        if y is None:
            y = self._gated_with_delta(x, lora, num_rows)
        return self.unfused_silu_and_mul(x, lora, num_rows) if y is None else y

    def _gated_with_delta(self, x: jax.Array, lora: LoRAMeta, num_rows: jax.Array | None) -> jax.Array | None:
        """silu(gate + delta_gate) * (up + delta_up) from the base GEMM kernel's gated epilogue, the delta the
        backend's `packed_delta` (its shrink and expand, run before the GEMM), where this bucket runs the base GEMM
        kernel on this 16-bit module without a bias and the backend hands the delta over; else None."""
        kernel = self.kernel.get_value()
        if not self._runs_gated_base_gemm(kernel, x):
            return None
        if not fits_base_gemm(x, kernel, self.base_gemm, self.axes, gated=True):
            return None
        delta = self.backend.packed_delta(x, self.lora_a.get_value(), self._lora_bs(), lora, tp_size=self.tp_size)
        if delta is None:
            return None
        return base_gemm(x, kernel, self.base_gemm, self.axes, num_rows, gated=True, delta=delta)

    def _with_base(
        self,
        x: jax.Array,
        lora: LoRAMeta,
        num_rows: jax.Array | None,
        gated: bool = False,
        zero_padding: bool = True,
    ) -> jax.Array | None:
        """The backend's GEMM with the LoRA inside it (`apply_with_base`, no bias) where the step's metadata runs it
        and the base weight is 16-bit; None where it does not run or the module does not fit it. zero_padding as in
        `__call__` (gated outputs ignore it)."""
        if not lora.runs_base_gemm or self.fp8 is not None:
            return None
        return self.backend.apply_with_base(
            x,
            self.kernel.get_value(),
            self.lora_a.get_value(),
            self._lora_bs(),
            lora,
            tp_size=self.tp_size,
            input_sharded=self.row_parallel,
            output_sharded=not self.row_parallel,
            num_rows=num_rows,
            gated=gated,
            zero_padding=zero_padding,
        )

    def _lora_bs(self) -> tuple[jax.Array, ...]:
        """Each packed part's B buffer, in part order."""
        return tuple(getattr(self, lora_b_name(name)).get_value() for name in self.part_names)


def lora_b_name(part_name: str) -> str:
    return f"lora_b_{part_name}" if part_name else "lora_b"
