"""Auto LoRA backend: picks a backend per platform and per (token bucket, segment bucket) at trace time.

Both buckets are static shapes (T = x.shape[0], G = lora.num_segments), so the choice is made once per
compiled bucket and costs nothing at run time. The table comes from scripts/bench_lora_kernels.py; the
measurements behind it are in docs/benchmarks.md ("LoRA kernels") and the reasoning in
docs/lora_backends.md. Platforms without measurements use the one-hot einsum baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sgl_jax_lora.lora.backend.base import LoRABackend
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas import PallasBackend
from sgl_jax_lora.lora.backend.sgmv import SgmvBackend
from sgl_jax_lora.lora.lora_batch import LoRABatch

# (max tokens, max segments, backend): first row that fits wins. Measured on an H100 (docs/benchmarks.md).
GPU_RULES: tuple[tuple[int, int, str], ...] = ((1 << 30, 1 << 30, "pallas"),)
# No TPU measurements yet: keep the baseline until the TPU kernel has been timed on a TPU.
DEFAULT_RULES: tuple[tuple[int, int, str], ...] = ((1 << 30, 1 << 30, "einsum"),)


def rules_for_platform(platform: str) -> tuple[tuple[int, int, str], ...]:
    return GPU_RULES if platform in ("gpu", "cuda") else DEFAULT_RULES


def choose_backend_name(platform: str, num_tokens: int, num_segments: int) -> str:
    for max_tokens, max_segments, name in rules_for_platform(platform):
        if num_tokens <= max_tokens and num_segments <= max_segments:
            return name
    return "einsum"


class AutoBackend(LoRABackend):
    name = "auto"

    def __init__(self, mesh: Mesh | None = None):
        super().__init__(mesh)
        self.platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.backends: dict[str, LoRABackend] = {
            "einsum": EinsumBackend(mesh),
            "bgmv": BgmvBackend(mesh),
            "sgmv": SgmvBackend(mesh),
            "pallas": PallasBackend(mesh),
        }

    def pick(self, num_tokens: int, lora: LoRABatch) -> LoRABackend:
        return self.backends[choose_backend_name(self.platform, num_tokens, lora.num_segments)]

    def shrink(
        self, x: jax.Array, lora_a: jax.Array, lora: LoRABatch, *, input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        return self.pick(x.shape[0], lora).shrink(x, lora_a, lora, input_sharded=input_sharded, rank_block=rank_block)

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        return self.pick(s.shape[0], lora).expand(s, lora_b, lora, output_sharded=output_sharded, out_dtype=out_dtype)

    def apply(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora_b: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        output_sharded: bool = False,
        base_out: jax.Array | None = None,
    ) -> jax.Array:
        return self.pick(x.shape[0], lora).apply(
            x, lora_a, lora_b, lora, input_sharded=input_sharded, output_sharded=output_sharded, base_out=base_out
        )
