"""XlaBackend: the shared base of the pure-JAX LoRA backends (einsum, bgmv, sgmv).

Where it sits: between `LoRABackend` (lora/backend/base.py) and the pure-JAX backends. Each of them defines
`shrink` (x -> s [T, R] f32) and `expand` (s -> [T, out]); `apply_packed` composes them in XLA: one shrink
on the stacked A of the packed parts (q|k|v, gate|up), the slot scale, one expand per part, the parts packed
shard-major and added to the base output. These backends need no metadata beyond the LoRABatch (the default
`prepare`), read one layer's slice of LayerStack views (`reads_stacked` False) and leave sharding to GSPMD
propagation (`constrain` pins their results' sharding on Auto-axis meshes).
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.layer_stack import LayerStack, as_layer_array
from sgl_jax_lora.layers.linear import pack_parts
from sgl_jax_lora.lora.backend.base import TENSOR_AXIS, LoRABackend, LoRAMeta
from sgl_jax_lora.lora.lora_batch import LoRABatch


class XlaBackend(LoRABackend):
    """A pure-JAX backend: `shrink` and `expand` in XLA, composed by `apply_packed`."""

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

        input_sharded: x and A split on `in` over 'tensor' (row-parallel layer); GSPMD all-reduces the partial
        [T, R] sums. rank_block: A's rows come in blocks of this many (unused here: no rank awareness)."""

    @abc.abstractmethod
    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        """s [T, R] float32, lora_b [A, out, R] -> [T, out] out_dtype, s_t @ B[slot_t].T.

        output_sharded: B split on `out` over 'tensor' (column-parallel layer); the result is split likewise."""

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
        lora = meta.batch
        lora_a, lora_bs = as_layer_array(lora_a), tuple(as_layer_array(b) for b in lora_bs)
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
