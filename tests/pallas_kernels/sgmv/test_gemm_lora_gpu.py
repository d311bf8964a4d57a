"""The base GEMM with the LoRA expand inside it (pallas_kernels/sgmv/gemm_lora_gpu.py).

On CPU: the entry table and the per-entry s layout against a construction from first principles, and the
tile choice against the shared-memory budget. Tests marked `gpu` run the Mosaic GPU kernel itself against
a float32 reference and are skipped without a Hopper-class CUDA device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.entry_table import build_entry_table, entries_needed, entry_s
from pallas_kernels.sgmv.gemm_lora_gpu import (
    GemmLoraTiles,
    choose_gemm_lora_split,
    choose_gemm_lora_tiles,
    gemm_lora_gpu,
    gemm_lora_gpu_entries,
)
from pallas_kernels.sgmv.reference import gemm_lora_ref

_GPU = jax.devices()[0] if jax.default_backend() == "gpu" else None
HAS_HOPPER = _GPU is not None and float(getattr(_GPU, "compute_capability", "0")) >= 9.0


def random_runs(rng, num_tokens: int, runs: int, num_slots: int) -> np.ndarray:
    lengths = rng.multinomial(num_tokens - runs, np.ones(runs) / runs) + 1
    return np.repeat(rng.integers(0, num_slots, runs), lengths).astype(np.int32)


def expected_entries(token_slot: np.ndarray, slot_scale: np.ndarray, tile_m: int):
    """Per row tile, the list of (slot, rows) of its runs of adapter tokens, in token order."""
    tiles = []
    for start in range(0, len(token_slot), tile_m):
        runs = []
        for row, slot in enumerate(token_slot[start : start + tile_m]):
            if slot_scale[slot] == 0:
                continue
            if runs and runs[-1][0] == slot and runs[-1][1][-1] == row - 1:
                runs[-1][1].append(row)
            else:
                runs.append((int(slot), [row]))
        tiles.append(runs)
    return tiles


@pytest.mark.parametrize(
    "seed,num_tokens,tile_m,runs", [(0, 64, 16, 1), (1, 64, 16, 9), (2, 96, 32, 30), (3, 128, 8, 50)]
)
def test_entry_table_matches_runs_per_tile(seed, num_tokens, tile_m, runs):
    rng = np.random.default_rng(seed)
    slot_scale = np.array([0.0, 0.5, 2.0, 1.0, 0.25], np.float32)  # slot 0 = base
    token_slot = random_runs(rng, num_tokens, runs, len(slot_scale))
    s = rng.standard_normal((num_tokens, 16)).astype(np.float32)
    needed = entries_needed(token_slot, slot_scale, tile_m)
    table = build_entry_table(jnp.asarray(token_slot), jnp.asarray(slot_scale), tile_m=tile_m, max_entries=needed + 3)
    laid_out = np.asarray(entry_s(jnp.asarray(s), table).astype(jnp.float32))
    entry_start, entry_slot = np.asarray(table.entry_start), np.asarray(table.entry_slot)

    expected = expected_entries(token_slot, slot_scale, tile_m)
    assert sum(len(runs) for runs in expected) == needed == entry_start[-1]
    for tile, runs in enumerate(expected):
        first, end = entry_start[tile], entry_start[tile + 1]
        assert end - first == len(runs)
        for entry, (slot, rows) in zip(range(first, end), runs):
            assert entry_slot[entry] == slot
            want = np.zeros((tile_m, 16), np.float32)
            want[rows] = s[tile * tile_m + np.array(rows)] * slot_scale[slot]
            np.testing.assert_allclose(laid_out[entry], want, rtol=1e-2, atol=1e-2)  # bf16 rounding
    assert not laid_out[needed:].any()  # spare entries stay zero


def test_entry_table_all_base_has_no_entries():
    table = build_entry_table(jnp.zeros(32, jnp.int32), jnp.array([0.0, 1.0]), tile_m=16, max_entries=1)
    assert np.asarray(table.entry_start).tolist() == [0, 0, 0]
    assert not np.asarray(entry_s(jnp.ones((32, 16)), table)).any()


def test_entry_table_drops_entries_past_the_bound():
    """Entries past max_entries are left out and row tiles' ranges clamp to the bound (never past it)."""
    token_slot = np.repeat(np.arange(1, 9), 4).astype(np.int32)  # 8 runs of 4 tokens, 2 row tiles of 16
    table = build_entry_table(jnp.asarray(token_slot), jnp.ones(9), tile_m=16, max_entries=3)
    assert np.asarray(table.entry_start).tolist() == [0, 3, 3]
    assert np.asarray(table.entry_slot).tolist() == [1, 2, 3]


def test_tokens_must_fill_row_tiles():
    with pytest.raises(ValueError, match="multiple of the 128-row tile"):
        build_entry_table(jnp.zeros(100, jnp.int32), jnp.ones(2), tile_m=128, max_entries=4)


@pytest.mark.parametrize("rank", [16, 32, 64])
def test_chosen_tiles_fit_shared_memory(rank):
    tiles = choose_gemm_lora_tiles(rank)
    assert tiles.smem_bytes(rank) <= 227 * 1024 - 1024
    deeper = GemmLoraTiles(stages=tiles.stages + 1, epilogue_n=tiles.epilogue_n)
    assert tiles.stages == 4 or deeper.smem_bytes(rank) + 1024 > 227 * 1024


LLAMA3_8B_MODULES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.mark.parametrize(
    "num_tokens,rank,split",
    [(512, 16, {"o": 2, "down": 2}), (256, 16, {"qkv": 2, "o": 4, "down": 4}), (1024, 16, {}), (512, 64, {})],
)
def test_split_k_where_the_tiles_leave_sms_idle(num_tokens, rank, split):
    """On 132 SMs the modules whose CTA tiles fill less than half of them cut the K loop, with float32 epilogue
    stores that fit beside the LoRA tiles at a pipeline of at least 3 stages; rank 64 leaves 2 stages: unsplit."""
    for module, (in_dim, out_dim) in LLAMA3_8B_MODULES.items():
        tiles, k_splits = choose_gemm_lora_split(num_tokens, in_dim, out_dim, rank, num_sms=132)
        assert k_splits == split.get(module, 1), module
        num_tiles = (num_tokens // 128) * (out_dim // 256)
        assert k_splits == 1 or num_tiles * k_splits <= 132
        itemsize = 4 if k_splits > 1 else 2
        assert tiles.smem_bytes(rank, itemsize) + 1024 <= 227 * 1024
        assert k_splits == 1 or (tiles.stages >= 3 and tiles.epilogue_n == 32)
    assert choose_gemm_lora_split(512, 4096, 4096, 16, num_sms=0)[1] == 1  # no SM count (off GPUs): one part


def test_split_k_with_lora_lowers_for_cuda(monkeypatch):
    """The kernel with LoRA entries and the K loop in 2 parts, lowered for CUDA on this CPU machine (Mosaic GPU's
    lowering needs no device): [2 * T, out] float32 parts, summed once to bf16 [T, out]."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    num_tokens, in_dim, out_dim, rank, num_entries = 256, 512, 512, 16, 4
    shapes = (
        jax.ShapeDtypeStruct((num_tokens, in_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((in_dim, out_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens // 128 + 1,), jnp.int32),
        jax.ShapeDtypeStruct((num_entries,), jnp.int32),
        jax.ShapeDtypeStruct((num_entries, 128, rank), jnp.bfloat16),
        (jax.ShapeDtypeStruct((3, out_dim, rank), jnp.bfloat16),),
    )
    tiles = choose_gemm_lora_tiles(rank, out_itemsize=4)
    call = jax.jit(gemm_lora_gpu_entries, static_argnames=("tiles", "k_splits"))
    lowered = call.trace(*shapes, tiles=tiles, k_splits=2).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and f"tensor<{2 * num_tokens}x{out_dim}xf32>" in text
    assert lowered.out_info.shape == (num_tokens, out_dim) and lowered.out_info.dtype == jnp.bfloat16


def test_rank_too_large_for_shared_memory_is_refused():
    with pytest.raises(ValueError, match="no tiles fit shared memory at rank 256"):
        choose_gemm_lora_tiles(256)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize(
    "seed,num_tokens,in_dim,widths,rank,runs",
    [
        (0, 256, 256, (256,), 16, 1),
        (1, 512, 1024, (512,), 16, 7),
        (2, 512, 512, (1024,), 64, 13),
        (3, 1024, 512, (512,), 16, 40),
        (4, 384, 256, (512,), 32, 3),
        (5, 512, 256, (512, 256, 256), 16, 9),
        (6, 256, 512, (768, 768), 64, 4),
    ],
)
def test_gemm_lora_gpu_matches_reference(seed, num_tokens, in_dim, widths, rank, runs):
    """One module (one part) or a packed one (q|k|v- and gate|up-like parts side by side, each with its own B
    and its own R columns of s), against the float32 reference part by part; then the same W and B as layer 1
    of [L, ...] stacks, which the kernel must read in place."""
    rng = np.random.default_rng(seed)
    num_slots = 9
    token_slot = random_runs(rng, num_tokens, runs, num_slots)
    slot_scale = np.where(np.arange(num_slots) > 0, 0.5, 0.0).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((in_dim, sum(widths))) * 0.05, jnp.bfloat16)
    lora_bs = tuple(jnp.asarray(rng.standard_normal((num_slots, width, rank)), jnp.bfloat16) for width in widths)
    s = jnp.asarray(rng.standard_normal((num_tokens, len(widths) * rank)), jnp.float32)
    tiles = choose_gemm_lora_tiles(rank)
    table = build_entry_table(
        jnp.asarray(token_slot),
        jnp.asarray(slot_scale),
        tile_m=tiles.tile_m,
        max_entries=entries_needed(token_slot, slot_scale, tiles.tile_m),
    )
    columns = np.cumsum((0,) + widths)

    def reference(scale):
        return jnp.concatenate(
            [
                gemm_lora_ref(
                    x,
                    w[:, columns[p] : columns[p + 1]],
                    s[:, p * rank : (p + 1) * rank],
                    jnp.asarray(token_slot),
                    scale,
                    b,
                )
                for p, b in enumerate(lora_bs)
            ],
            axis=1,
        )

    ref = reference(jnp.asarray(slot_scale))
    delta = ref - reference(jnp.zeros(num_slots))
    assert float(jnp.max(jnp.abs(delta))) > 0.5 * float(jnp.max(jnp.abs(ref)))  # the LoRA part is not negligible

    y = gemm_lora_gpu(x, w, s, table, lora_bs, tiles=tiles).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) < 1e-2  # bf16 output

    w_stack = jnp.stack([w * 2, w])  # [L=2, in, out]: the kernel offsets to layer 1's rows
    b_stacks = tuple(jnp.stack([jnp.zeros_like(b), b]) for b in lora_bs)  # [L=2, A, out_p, R]
    y_stacked = gemm_lora_gpu(x, w_stack, s, table, b_stacks, jnp.int32(1), tiles=tiles).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(y_stacked), np.asarray(y))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize(
    "seed,num_tokens,in_dim,widths,runs,k_splits",
    [(10, 512, 4096, (4096,), 32, 2), (11, 512, 14336, (4096,), 32, 2), (12, 256, 4096, (4096, 1024, 1024), 9, 4)],
)
def test_split_k_with_lora_matches_reference(seed, num_tokens, in_dim, widths, runs, k_splits):
    """o-, down- and q|k|v-sized modules at decode sizes (rank 16, adapters' runs as the scheduler groups decode
    rows) with the K loop in parts: each entry is added once (by the first part) and the sum matches the float32
    reference and the unsplit kernel; W and B read in place as layer 1 of two-layer stacks."""
    rng = np.random.default_rng(seed)
    rank, num_slots = 16, 33
    token_slot = random_runs(rng, num_tokens, runs, num_slots)
    slot_scale = np.where(np.arange(num_slots) > 0, 0.5, 0.0).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)) * 0.1, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, in_dim, sum(widths))) * 0.02, jnp.bfloat16)
    lora_bs = tuple(jnp.asarray(rng.standard_normal((2, num_slots, width, rank)), jnp.bfloat16) for width in widths)
    s = jnp.asarray(rng.standard_normal((num_tokens, len(widths) * rank)), jnp.float32)
    table = build_entry_table(
        jnp.asarray(token_slot),
        jnp.asarray(slot_scale),
        tile_m=128,
        max_entries=entries_needed(token_slot, slot_scale, 128),
    )
    columns = np.cumsum((0,) + widths)
    ref = jnp.concatenate(
        [
            gemm_lora_ref(
                x,
                w[1][:, columns[p] : columns[p + 1]],
                s[:, p * rank : (p + 1) * rank],
                jnp.asarray(token_slot),
                jnp.asarray(slot_scale),
                b[1],
            )
            for p, b in enumerate(lora_bs)
        ],
        axis=1,
    )
    split = gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), k_splits=k_splits).astype(jnp.float32)
    unsplit = gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1)).astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(ref)))
    assert float(jnp.max(jnp.abs(split - ref))) < 1e-2 * scale  # bf16 output
    assert float(jnp.max(jnp.abs(split - unsplit))) < 1e-2 * scale
    # a bucket with fewer real tokens: the padding's row tiles skipped, the real rows as in the full bucket, bit for
    # bit (the same tiles and entries, only fewer), the rest zero
    for rows in (0, 100, 256, 345):
        rows = min(rows, num_tokens)
        part = gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), jnp.full((1,), rows, jnp.int32), k_splits=k_splits)
        part = np.asarray(part.astype(jnp.float32))
        np.testing.assert_array_equal(part[:rows], np.asarray(split)[:rows])
        assert not part[rows:].any(), rows
