"""PallasTPUBackend: the Mosaic SGMV kernels (pallas_kernels/sgmv/tpu.py) behind the LoRA backend interface.

Where it sits: `--lora-backend pallas` on TPU (make_pallas_backend, lora/backend/pallas.py, which also holds the
sharding and the `apply_packed` both Pallas backends share). It needs no metadata beyond the LoRABatch (the
default `prepare`): the kernels build their work list at trace time.

Rank awareness: the kernel skips the matmul of base segments but its weight DMA always moves the full R (static
block shape). Projection sizes: any; the kernels pad sizes that are not multiples of 128 lanes at trace time and
slice back (docs/lora_backends.md "Projection sizes"). `apply_packed` runs one shrink on the stacked A and one
expand per part, the deltas packed side by side and added to the base output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_kernels.sgmv.tpu import expand_weights_view, sgmv_expand_tpu, sgmv_shrink_tpu
from sgl_jax_lora.lora.backend.base import LoRAMeta
from sgl_jax_lora.lora.backend.pallas import PallasBackend


def _segments(meta: LoRAMeta) -> tuple[jax.Array, ...]:
    lora = meta.batch
    return (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)


class PallasTPUBackend(PallasBackend):
    native_platforms = ("tpu",)

    def __init__(self, mesh: Mesh | None = None, interpret: bool | None = None):
        super().__init__(mesh, interpret)

    def _local_shrink_partials(
        self, x: jax.Array, lora_a: jax.Array, meta: LoRAMeta, rank_block: int | None, layer: jax.Array | None = None
    ) -> jax.Array:
        s = sgmv_shrink_tpu(x, lora_a, *_segments(meta), layer, rank_block=rank_block, interpret=self.interpret)
        return s[None]  # a single split

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
        """One launch per part, each part's columns side by side (the shard's packed layout)."""
        s2 = s.sum(0) if s.ndim == 3 else s
        if scale is not None:
            s2 = s2 * scale[meta.batch.token_slot][:, None]
        max_rank = lora_bs[0].shape[-1]
        deltas = []
        for i, b in enumerate(lora_bs):
            b, rank_major = expand_weights_view(b)  # B as the TPU holds it: no relayout of the pool a step
            deltas.append(
                sgmv_expand_tpu(
                    s2[:, i * max_rank : (i + 1) * max_rank],
                    b,
                    *_segments(meta),
                    layer,
                    out_dtype=out_dtype,
                    rank_major=rank_major,
                    interpret=self.interpret,
                )
            )
        delta = deltas[0] if len(deltas) == 1 else jnp.concatenate(deltas, axis=1)
        if base_out is None:
            return delta
        return (base_out.astype(jnp.float32) + delta.astype(jnp.float32)).astype(out_dtype)
