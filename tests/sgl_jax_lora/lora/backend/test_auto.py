"""sgl_jax_lora/lora/backend/auto.py: which backend AutoBackend picks per platform, token bucket, segment bucket and
module width (the first row of the platform's table that fits, checked at each row's edges; the einsum baseline off
GPU and when no row fits), that Pallas prefill buckets running the GEMM with the LoRA inside it take Pallas whatever
the table says, that `prepare` builds the Pallas metadata only for buckets that run a module on Pallas, and that
`apply_packed` / `apply_with_base` hand the call, unchanged, to the chosen backend (results equal to its own)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.lora.backend import auto
from sgl_jax_lora.lora.backend.auto import AutoBackend, choose_backend_name, rules_for_platform
from sgl_jax_lora.lora.backend.base import LoRABackend, LoRAMeta
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUMeta
from sgl_jax_lora.lora.backend.sgmv import SgmvBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from tests.support.lora_backends import random_slots

SLOT_RANKS = (0, 4, 8, 2)
SLOT_SCALE = np.array([0.0, 2.0, 0.5, 1.5], np.float32)

# Each GPU table row's edges, read off GPU_RULES by hand: (tokens, segments) -> backend.
GPU_EDGES = {
    (1, 1): "sgmv",  # row 1: T <= 1, G <= 1
    (1, 2): "bgmv",  # one segment too many for row 1: row 2 (T <= 16)
    (2, 1): "bgmv",
    (16, 1): "bgmv",
    (16, 4096): "bgmv",
    (17, 1): "pallas",  # row 3: T <= 64
    (64, 1000): "pallas",
    (65, 1): "sgmv",  # row 4: T <= 1024, G <= 1
    (1024, 1): "sgmv",
    (65, 2): "pallas",  # row 5: T <= 1024
    (1024, 4096): "pallas",
    (1025, 1): "sgmv",  # row 6: T <= 4096, G <= 4
    (4096, 4): "sgmv",
    (1025, 5): "pallas",  # row 7: the rest
    (4097, 1): "pallas",
    (1 << 20, 1 << 20): "pallas",
}


def lora_batch(num_tokens: int, num_segments: int, seed: int = 0):
    token_slot = np.random.default_rng(seed).integers(0, len(SLOT_RANKS), num_tokens).astype(np.int32)
    token_slot[: min(num_tokens, num_segments)] = np.arange(min(num_tokens, num_segments)) % len(SLOT_RANKS)
    used = len(np.unique(token_slot))
    lora = build_lora_batch(token_slot, max(num_segments, used), SLOT_SCALE, np.array(SLOT_RANKS))
    return jax.tree_util.tree_map(jnp.asarray, lora)


def test_the_gpu_table_at_each_rows_edges():
    for (tokens, segments), name in GPU_EDGES.items():
        assert choose_backend_name("gpu", tokens, segments) == name, (tokens, segments)
        assert choose_backend_name("cuda", tokens, segments) == name
        # every row takes any width today (min width 0)
        assert choose_backend_name("gpu", tokens, segments, 1 << 16) == name


@pytest.mark.parametrize("platform", ["cpu", "tpu", "rocm"])
def test_platforms_without_measurements_keep_the_einsum_baseline(platform):
    assert rules_for_platform(platform) == auto.DEFAULT_RULES
    for tokens, segments in GPU_EDGES:
        assert choose_backend_name(platform, tokens, segments, 4096) == "einsum"
    assert rules_for_platform("gpu") is auto.GPU_RULES


def test_the_first_row_that_fits_wins_and_no_row_falls_back_to_einsum(monkeypatch):
    # a table with a minimum width: wide modules of small buckets take pallas, narrow ones bgmv, big buckets nothing
    monkeypatch.setattr(auto, "GPU_RULES", ((64, 8, 4096, "pallas"), (64, 8, 0, "bgmv"), (64, 8, 0, "sgmv")))
    assert choose_backend_name("gpu", 64, 8, 4096) == "pallas"
    assert choose_backend_name("gpu", 64, 8, 4095) == "bgmv"
    assert choose_backend_name("gpu", 64, 8) == "bgmv"
    assert choose_backend_name("gpu", 65, 8, 4096) == "einsum"
    assert choose_backend_name("gpu", 64, 9, 4096) == "einsum"


def test_chosen_follows_the_table_of_its_platform():
    backend = AutoBackend(None)
    assert backend.platform == jax.default_backend()
    assert set(backend.backends) == {"einsum", "bgmv", "sgmv", "pallas"}
    assert isinstance(backend.backends["sgmv"], SgmvBackend) and backend.backends["pallas"].name == "pallas"
    backend.platform = "cpu"
    assert backend.chosen(64, 8) is backend.backends["einsum"]
    backend.platform = "gpu"  # the table, not the machine
    for (tokens, segments), name in GPU_EDGES.items():
        assert backend.chosen(tokens, segments, 4096) is backend.backends[name]


def test_fused_gemm_prefill_buckets_take_pallas_at_any_segment_count():
    backend = AutoBackend(None, fused_gemm_min_tokens=256)
    pallas = backend.backends["pallas"]
    assert pallas.fused_gemm_min_tokens == 256
    # from 256 tokens, in whole row tiles (128): Pallas even where the CPU table says einsum
    for tokens, segments in [(256, 1), (256, 64), (384, 4), (4096, 4)]:
        assert backend.chosen(tokens, segments) is pallas, (tokens, segments)
    for tokens in (128, 255, 257, 300):  # below the minimum, or not a whole number of tiles
        assert backend.chosen(tokens, 4) is backend.backends["einsum"], tokens
    default = AutoBackend(None)  # off by default on CPU
    assert default.backends["pallas"].fused_gemm_min_tokens == 0
    assert default.chosen(4096, 4) is default.backends["einsum"]


def prepared(backend: AutoBackend, num_tokens: int, num_segments: int, num_seqs: int) -> LoRAMeta:
    """The step metadata `prepare` builds, inside jit as in the engine's forward."""
    return jax.jit(lambda lora: backend.prepare(lora, num_seqs))(lora_batch(num_tokens, num_segments))


def test_prepare_builds_pallas_metadata_only_for_buckets_that_run_pallas():
    backend = AutoBackend(None)
    meta = prepared(backend, 64, 4, 8)
    assert type(meta) is LoRAMeta and not meta.runs_base_gemm  # CPU: einsum everywhere
    backend.platform = "gpu"
    assert type(prepared(backend, 8, 4, 8)) is LoRAMeta  # bgmv bucket
    meta = prepared(backend, 64, 4, 8)  # pallas bucket
    assert isinstance(meta, PallasGPUMeta) and meta.work is not None and not meta.runs_base_gemm
    fused = prepared(AutoBackend(None, fused_gemm_min_tokens=128), 256, 4, 4)
    assert isinstance(fused, PallasGPUMeta) and fused.runs_base_gemm


class Recorder(LoRABackend):
    """Records what it is handed; returns a marker."""

    def __init__(self):
        super().__init__(None)
        self.calls = []

    def fused_gemm_tile_rows(self, num_tokens: int, num_segments: int) -> int:
        return 0  # as the Pallas backend where it runs no GEMM with the LoRA inside it

    def apply_packed(self, *args, **kwargs):
        self.calls.append(("apply_packed", args, kwargs))
        return "packed"

    def apply_with_base(self, *args, **kwargs):
        self.calls.append(("apply_with_base", args, kwargs))
        return "with_base"

    def packed_delta(self, *args, **kwargs):
        self.calls.append(("packed_delta", args, kwargs))
        return "delta"


def test_calls_go_to_the_backend_chosen_for_the_modules_total_width(monkeypatch):
    backend = AutoBackend(None)
    recorders = {name: Recorder() for name in backend.backends}
    monkeypatch.setattr(backend, "backends", recorders)
    monkeypatch.setattr(auto, "DEFAULT_RULES", ((64, 8, 48, "bgmv"), (64, 8, 0, "sgmv")))
    x, meta = jnp.zeros((16, 32)), LoRAMeta(lora_batch(16, 4))
    lora_a = jnp.zeros((4, 16, 32))
    narrow, wide = (jnp.zeros((4, 24, 8)),) * 2, (jnp.zeros((4, 24, 8)), LayerStack(jnp.zeros((2, 4, 24, 8)), 1))
    kw = dict(tp_size=2, input_sharded=True, output_sharded=False)
    assert backend.apply_packed(x, lora_a, narrow[:1], meta, "base", **kw) == "packed"  # width 24
    assert backend.apply_packed(x, lora_a, wide, meta, "base", **kw) == "packed"  # width 24 + 24 (one a stack)
    assert [len(recorders[n].calls) for n in ("sgmv", "bgmv")] == [1, 1]
    _, args, kwargs = recorders["bgmv"].calls[0]
    assert args == (x, lora_a, wide, meta, "base") and kwargs == kw
    # apply_with_base chooses by bucket alone (width 0): sgmv here
    rows = jnp.full((1,), 12, jnp.int32)
    assert backend.apply_with_base(x, "kernel", lora_a, wide, meta, **kw, num_rows=rows, gated=True) == "with_base"
    assert recorders["sgmv"].calls[-1] == (
        "apply_with_base",
        (x, "kernel", lora_a, wide, meta),
        kw | {"num_rows": rows, "gated": True, "zero_padding": True},
    )
    backend.apply_with_base(x, "kernel", lora_a, wide, meta, **kw, num_rows=rows, zero_padding=False)
    assert recorders["sgmv"].calls[-1][2] == kw | {"num_rows": rows, "gated": False, "zero_padding": False}
    # packed_delta chooses by the module's width, as apply_packed
    assert backend.packed_delta(x, lora_a, wide, meta, tp_size=2) == "delta"
    assert recorders["bgmv"].calls[-1] == ("packed_delta", (x, lora_a, wide, meta), {"tp_size": 2})


@pytest.mark.parametrize(("platform", "num_tokens", "expected"), [("cpu", 16, EinsumBackend), ("gpu", 8, BgmvBackend)])
def test_results_equal_the_chosen_backends(platform, num_tokens, expected):
    x, lora_a, lora_b, _ = random_slots(
        3, num_tokens=num_tokens, in_dim=32, out_dim=24, slot_ranks=SLOT_RANKS, max_rank=8
    )
    lora = lora_batch(num_tokens, 4, seed=3)
    base = jnp.asarray(np.random.default_rng(4).standard_normal((num_tokens, 24)), jnp.float32)
    backend = AutoBackend(None)
    backend.platform = platform
    assert isinstance(backend.chosen(num_tokens, 4, 24), expected)
    operands = (jnp.asarray(x), jnp.asarray(lora_a), (jnp.asarray(lora_b),))
    got = backend.apply_packed(*operands, backend.prepare(lora, num_tokens), base, tp_size=1)
    want = expected(None).apply_packed(*operands, LoRAMeta(lora), base, tp_size=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(base))
    assert backend.apply_with_base(operands[0], jnp.zeros((32, 24)), *operands[1:], LoRAMeta(lora), tp_size=1) is None
