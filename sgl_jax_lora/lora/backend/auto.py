"""Auto LoRA backend: picks a backend per platform, per (token bucket, segment bucket) and per module width,
at trace time.

Both buckets are static shapes (T = x.shape[0], G = lora.num_segments), and so is a module's output width
(the sum of its parts' widths: q|k|v, gate|up), so the choice is made once per compiled bucket and layer
module and costs nothing at run time. The table comes from scripts/bench_lora_kernels.py,
scripts/tune_gpu_sgmv.py and, for decode buckets, whole-model forwards (scripts/profile_step.py); the
measurements behind it are in docs/benchmarks.md and the reasoning in docs/lora_backends.md. Platforms
without measurements use the one-hot einsum baseline.

Where it sits: `--lora-backend auto` (the default), over the other backends (`AutoBackend.backends`, the Pallas
one from make_pallas_backend). `prepare` returns the Pallas backend's metadata when the bucket runs any module on
it, else the plain LoRAMeta; `apply_packed`, `packed_delta` and `apply_with_base` go to the backend `chosen` for
the module.
What exists here: GPU_RULES, DEFAULT_RULES, `choose_backend_name`, `AutoBackend`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from sgl_jax_lora.layers.layer_stack import LayerStack, layer_shape
from sgl_jax_lora.lora.backend.base import LoRABackend, LoRAMeta
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas import make_pallas_backend
from sgl_jax_lora.lora.backend.sgmv import SgmvBackend
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
    """Delegates each module's call to the backend chosen for its bucket and width (`chosen`); its metadata is
    the Pallas backend's when that backend runs any module of the bucket, else the plain LoRAMeta."""

    name = "auto"

    def __init__(self, mesh: Mesh | None = None, fused_gemm_min_tokens: int | None = None):
        super().__init__(mesh)
        self.platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.backends: dict[str, LoRABackend] = {
            "einsum": EinsumBackend(mesh),
            "bgmv": BgmvBackend(mesh),
            "sgmv": SgmvBackend(mesh),
            "pallas": make_pallas_backend(mesh, fused_gemm_min_tokens=fused_gemm_min_tokens),
        }

    def chosen(self, num_tokens: int, num_segments: int, out_features: int = 0) -> LoRABackend:
        """Prefill buckets where the Pallas backend runs the GEMM with the LoRA inside it take it at any
        segment count (below the SGMV path in every measured bucket: docs/lora_backends.md); the table otherwise."""
        if self.backends["pallas"].fused_gemm_tile_rows(num_tokens, num_segments):
            return self.backends["pallas"]
        return self.backends[choose_backend_name(self.platform, num_tokens, num_segments, out_features)]

    def prepare(self, lora: LoRABatch, num_seqs: int, max_chunks: int | None = None) -> LoRAMeta:
        num_tokens, num_segments = lora.token_slot.shape[0], lora.num_segments
        pallas = self.backends["pallas"]
        if any(self.chosen(num_tokens, num_segments, width) is pallas for width in (0, _ANY)):
            return pallas.prepare(lora, num_seqs, max_chunks)
        return LoRAMeta(lora)

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
        backend = self.chosen(x.shape[0], meta.batch.num_segments, sum(_width(b) for b in lora_bs))
        return backend.apply_packed(
            x,
            lora_a,
            lora_bs,
            meta,
            base_out,
            tp_size=tp_size,
            input_sharded=input_sharded,
            output_sharded=output_sharded,
        )

    def packed_delta(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        *,
        tp_size: int,
    ) -> jax.Array | None:
        backend = self.chosen(x.shape[0], meta.batch.num_segments, sum(_width(b) for b in lora_bs))
        return backend.packed_delta(x, lora_a, lora_bs, meta, tp_size=tp_size)

    def delta_holding_input(
        self,
        x: jax.Array,
        lora_a: jax.Array | LayerStack,
        lora_bs: tuple[jax.Array | LayerStack, ...],
        meta: LoRAMeta,
        *,
        tp_size: int,
    ) -> tuple[jax.Array, jax.Array] | None:
        backend = self.chosen(x.shape[0], meta.batch.num_segments, sum(_width(b) for b in lora_bs))
        return backend.delta_holding_input(x, lora_a, lora_bs, meta, tp_size=tp_size)

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
        return self.chosen(x.shape[0], meta.batch.num_segments).apply_with_base(
            x,
            kernel,
            lora_a,
            lora_bs,
            meta,
            tp_size=tp_size,
            input_sharded=input_sharded,
            output_sharded=output_sharded,
            num_rows=num_rows,
            gated=gated,
            zero_padding=zero_padding,
        )
