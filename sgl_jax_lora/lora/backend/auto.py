"""Auto LoRA backend: picks a backend per platform, per (token bucket, segment bucket) and per module width,
at trace time.

Both buckets are static shapes (T = x.shape[0], G = lora.num_segments), and so is a module's output width
(the sum of its parts' widths: q|k|v, gate|up), so the choice is made once per compiled bucket and layer
module and costs nothing at run time. The table comes from scripts/bench_lora_kernels.py,
scripts/tune_gpu_sgmv.py and, for decode buckets, whole-model forwards (scripts/profile_step.py); the
measurements behind it are in docs/benchmarks.md and the reasoning in docs/lora_backends.md. Platforms
without measurements use the one-hot einsum baseline.
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
from sgl_jax_lora.lora.layer_stack import LayerStack, layer_shape
from sgl_jax_lora.lora.lora_batch import LoRABatch

# (max tokens, max segments, min output width, backend): the first row that fits wins. From the H100 runs
# in docs/benchmarks.md ("LoRA kernels"); docs/lora_backends.md ("What auto chooses, and why") gives the
# per-row reasoning. Token buckets between 256 and 2048 were not measured and take the T = 256 choice.
_ANY = 1 << 30
GPU_RULES: tuple[tuple[int, int, int, str], ...] = (
    (1, 1, 0, "sgmv"),  # T=1, one segment: sgmv 1.22 vs bgmv 1.60
    (16, _ANY, 0, "bgmv"),  # small decode buckets: gate|up T=8: bgmv 1.05-1.09 vs pallas 1.15-1.16
    (64, _ANY, 0, "pallas"),  # T=32/64: 8-layer decode forward, 32 adapters: 3.96 ms vs 4.17 (bgmv q|k|v, o, down)
    (1024, 1, 0, "sgmv"),  # T=256, one segment: sgmv 1.24 vs pallas 1.36
    (1024, _ANY, 0, "pallas"),  # T=256: best or tied in 7 of 8 multi-segment rows
    (4096, 4, 0, "sgmv"),  # prefill <= 4 segments up to T=4096: sgmv 1.13 / 1.17 vs pallas 1.34 / 1.25
    (_ANY, _ANY, 0, "pallas"),  # every other prefill row
)
# No TPU measurements yet: keep the baseline until the TPU kernel has been timed on a TPU.
DEFAULT_RULES: tuple[tuple[int, int, int, str], ...] = ((_ANY, _ANY, 0, "einsum"),)


def rules_for_platform(platform: str) -> tuple[tuple[int, int, int, str], ...]:
    return GPU_RULES if platform in ("gpu", "cuda") else DEFAULT_RULES


def choose_backend_name(platform: str, num_tokens: int, num_segments: int, out_features: int = 0) -> str:
    """The backend for a (token bucket, segment bucket) and a module of `out_features` output columns."""
    for max_tokens, max_segments, min_out, name in rules_for_platform(platform):
        if num_tokens <= max_tokens and num_segments <= max_segments and out_features >= min_out:
            return name
    return "einsum"


def _width(weight: jax.Array | LayerStack) -> int:
    return layer_shape(weight)[-2]


class AutoBackend(LoRABackend):
    name = "auto"

    def __init__(self, mesh: Mesh | None = None, fused_gemm_min_tokens: int | None = None):
        super().__init__(mesh)
        self.platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.backends: dict[str, LoRABackend] = {
            "einsum": EinsumBackend(mesh),
            "bgmv": BgmvBackend(mesh),
            "sgmv": SgmvBackend(mesh),
            "pallas": PallasBackend(mesh, fused_gemm_min_tokens=fused_gemm_min_tokens),
        }

    def chosen(self, num_tokens: int, num_segments: int, out_features: int = 0) -> LoRABackend:
        """Prefill buckets where the Pallas backend runs the GEMM with the LoRA inside it take it at any
        segment count (below the SGMV path in every measured bucket: docs/lora_backends.md); the table otherwise."""
        if self.backends["pallas"].fused_gemm_tile_rows(num_tokens, num_segments):
            return self.backends["pallas"]
        return self.backends[choose_backend_name(self.platform, num_tokens, num_segments, out_features)]

    def fused_gemm_tile_rows(self, num_tokens: int, num_segments: int) -> int:
        return self.backends["pallas"].fused_gemm_tile_rows(num_tokens, num_segments)

    def pick(self, num_tokens: int, lora: LoRABatch, out_features: int = 0) -> LoRABackend:
        return self.chosen(num_tokens, lora.num_segments, out_features)

    def work_block_rows(self, num_tokens: int, num_segments: int) -> int:
        """The work list's row tile if the module of any width picks a backend that reads one."""
        return max(
            self.chosen(num_tokens, num_segments, width).work_block_rows(num_tokens, num_segments)
            for width in (0, _ANY)
        )

    def reads_stacked(self, num_tokens: int, num_segments: int, out_features: int = 0) -> bool:
        return self.chosen(num_tokens, num_segments, out_features).reads_stacked(num_tokens, num_segments, out_features)

    def shrink(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora: LoRABatch,
        *,
        input_sharded: bool = False,
        rank_block: int | None = None,
    ) -> jax.Array:
        return self.pick(x.shape[0], lora).shrink(x, lora_a, lora, input_sharded=input_sharded, rank_block=rank_block)

    def expand(
        self, s: jax.Array, lora_b: jax.Array, lora: LoRABatch, *, output_sharded: bool = False, out_dtype: jnp.dtype
    ) -> jax.Array:
        return self.pick(s.shape[0], lora, _width(lora_b)).expand(
            s, lora_b, lora, output_sharded=output_sharded, out_dtype=out_dtype
        )

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
        return self.pick(x.shape[0], lora, _width(lora_b)).apply(
            x, lora_a, lora_b, lora, input_sharded=input_sharded, output_sharded=output_sharded, base_out=base_out
        )

    def apply_with_base(self, x, kernel, lora_a, lora_bs, lora, *, tp_size, input_sharded=False, output_sharded=False):
        return self.pick(x.shape[0], lora).apply_with_base(
            x,
            kernel,
            lora_a,
            lora_bs,
            lora,
            tp_size=tp_size,
            input_sharded=input_sharded,
            output_sharded=output_sharded,
        )

    def apply_packed(
        self,
        x: jax.Array,
        lora_a: jax.Array,
        lora_bs: tuple[jax.Array, ...],
        lora: LoRABatch,
        base_out: jax.Array,
        *,
        tp_size: int,
        input_sharded: bool = False,
        output_sharded: bool = False,
    ) -> jax.Array:
        out_features = sum(_width(b) for b in lora_bs)
        return self.pick(x.shape[0], lora, out_features).apply_packed(
            x,
            lora_a,
            lora_bs,
            lora,
            base_out,
            tp_size=tp_size,
            input_sharded=input_sharded,
            output_sharded=output_sharded,
        )
