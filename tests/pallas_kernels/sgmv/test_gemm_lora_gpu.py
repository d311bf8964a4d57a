"""The base GEMM with the LoRA expand inside it (pallas_kernels/sgmv/gemm_lora_gpu.py).

On CPU: the entry table and the per-entry s layout against a construction from first principles, the tile choice
against the shared-memory budget, the kernel lowered for CUDA, and (with JAX 0.11 or later) the kernel body, plain and
gated, in JAX's Mosaic GPU interpreter. Tests marked `gpu` run the Mosaic GPU kernel itself against a float32
reference and are skipped without a Hopper-class CUDA device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.entry_table import build_entry_table, entries_needed, entry_s, entry_s_parts
from pallas_kernels.sgmv.gemm_lora_gpu import (
    GemmLoraTiles,
    choose_gemm_lora_split,
    choose_gemm_lora_tiles,
    gemm_lora_gpu,
    gemm_lora_gpu_entries,
    lora_kernel_call,
    part_tile_tables,
    silu_and_mul,
)
from pallas_kernels.sgmv.reference import gemm_lora_entries_ref, gemm_lora_ref
from tests.pallas_kernels.sgmv.test_gemm_gpu import kernel_output_is_returned, mosaic_gpu_interpreter

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


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rank", [16, 32, 64])
def test_a_ring_of_entry_buffers_keeps_three_stages_or_shrinks(rank, gated):
    """Two entry slots where they fit beside a pipeline of at least 3 stages, else one slot with the tiles one slot
    would get; always within shared memory."""
    tiles = choose_gemm_lora_tiles(rank, gated=gated, entry_slots=2)
    assert tiles.smem_bytes(rank, gated=gated) <= 227 * 1024 - 1024
    if tiles.entry_slots == 2:
        assert tiles.stages >= 3
    else:
        assert tiles == choose_gemm_lora_tiles(rank, gated=gated)
        three_stages = GemmLoraTiles(stages=3, epilogue_n=16, entry_slots=2)
        assert three_stages.smem_bytes(rank, gated=gated) + 1024 > 227 * 1024
    # per slot and warpgroup an s and a B tile, 8 KB at rank 16 (gated: gate's and up's, s of half the rows: 12 KB)
    expected = {16: (2, 3), 32: (1, 3) if gated else (2, 3), 64: (1, 2) if gated else (1, 3)}
    assert (tiles.entry_slots, tiles.stages) == expected[rank]


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
    call = jax.jit(gemm_lora_gpu_entries, static_argnames=("tiles", "k_splits"))
    for entry_slots in (1, 2):  # one entry buffer, and a ring of two
        tiles = choose_gemm_lora_tiles(rank, out_itemsize=4, entry_slots=entry_slots)
        assert tiles.entry_slots == entry_slots
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
        (7, 512, 512, (512, 256, 256), 16, 113),
    ],
)
@pytest.mark.parametrize("entry_slots", [1, 2])
def test_gemm_lora_gpu_matches_reference(seed, num_tokens, in_dim, widths, rank, runs, entry_slots):
    """One module (one part) or a packed one (q|k|v- and gate|up-like parts side by side, each with its own B
    and its own R columns of s), against the float32 reference part by part; then the same W and B as layer 1
    of [L, ...] stacks, which the kernel must read in place. With one entry buffer and a ring of two (where it fits
    the rank; 113 runs in 512 rows give the row tiles dozens of entries each, as decode rows of many adapters do)."""
    rng = np.random.default_rng(seed)
    num_slots = 9
    token_slot = random_runs(rng, num_tokens, runs, num_slots)
    slot_scale = np.where(np.arange(num_slots) > 0, 0.5, 0.0).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((in_dim, sum(widths))) * 0.05, jnp.bfloat16)
    lora_bs = tuple(jnp.asarray(rng.standard_normal((num_slots, width, rank)), jnp.bfloat16) for width in widths)
    s = jnp.asarray(rng.standard_normal((num_tokens, len(widths) * rank)), jnp.float32)
    tiles = choose_gemm_lora_tiles(rank, entry_slots=entry_slots)
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


# ---- gate|up with the MLP's activation in the epilogue ------------------------------------------------------------


@pytest.mark.parametrize("rank,stages,epilogue_n", [(16, 4, 16), (32, 3, 64), (64, 2, 64)])
def test_gated_tiles_fit_shared_memory(rank, stages, epilogue_n):
    """Per warpgroup gate's and up's s tiles of its half of the rows and their B tiles: at rank 16 the pipeline
    keeps its 4 stages with 16-column stores."""
    tiles = choose_gemm_lora_tiles(rank, gated=True)
    assert (tiles.stages, tiles.epilogue_n) == (stages, epilogue_n)
    assert tiles.smem_bytes(rank, gated=True) + 1024 <= 227 * 1024
    assert tiles.smem_bytes(rank, gated=True) > tiles.smem_bytes(rank)  # two B tiles a warpgroup, not one


def gated_operands(seed, num_tokens, in_dim, inter_dim, rank, runs, num_slots=9):
    """x, a [2, in, 2I] stack of [gate | up] W, gate's and up's B as [2, A, I, R] stacks, s [T, 2R] and the entry
    table of `runs` runs of adapter tokens."""
    rng = np.random.default_rng(seed)
    token_slot = random_runs(rng, num_tokens, runs, num_slots)
    slot_scale = np.where(np.arange(num_slots) > 0, 0.5, 0.0).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, in_dim, 2 * inter_dim)) / np.sqrt(in_dim), jnp.bfloat16)
    lora_bs = tuple(jnp.asarray(rng.standard_normal((2, num_slots, inter_dim, rank)) * 0.3, jnp.bfloat16) for _ in "gu")
    s = jnp.asarray(rng.standard_normal((num_tokens, 2 * rank)), jnp.float32)
    needed = entries_needed(token_slot, slot_scale, 128)
    table = build_entry_table(jnp.asarray(token_slot), jnp.asarray(slot_scale), tile_m=128, max_entries=needed)
    return x, w, lora_bs, s, table


def test_gated_reference_is_the_activation_of_the_packed_product():
    x, w, lora_bs, s, table = gated_operands(20, 256, 128, 256, 16, 5)
    rows = jnp.array([200], jnp.int32)
    gated = gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), rows, gated=True, reference=True)
    packed = gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), rows, reference=True)
    assert gated.shape == (256, 256) and gated.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(gated[:200], np.float32), np.asarray(silu_and_mul(packed)[:200], np.float32)
    )
    assert not np.asarray(gated, np.float32)[200:].any()


def test_gated_refuses_what_it_does_not_run():
    x, w, lora_bs, s, table = gated_operands(21, 256, 128, 256, 16, 5)
    with pytest.raises(ValueError, match="one K loop per tile"):
        gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), gated=True, k_splits=2)
    three_parts = (lora_bs[0][:, :, :128], lora_bs[0][:, :, 128:], lora_bs[1])
    with pytest.raises(ValueError, match="two parts of one width"):
        gemm_lora_gpu(x, w, jnp.tile(s, (1, 2))[:, :48], table, three_parts, jnp.int32(1), gated=True, reference=True)
    x, w, lora_bs, s, table = gated_operands(21, 256, 128, 192, 16, 5)  # gate and up of 192: not whole 128 tiles
    with pytest.raises(ValueError, match="each part's width of 128"):
        gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), gated=True, reference=True)


def interpreter_with_transposed_operands():
    """The Mosaic GPU interpreter's params where it runs a WGMMA on a transposed shared-memory operand (the LoRA
    loop's B tile; JAX 0.10's interpreter fails on it, 0.11's runs it), else None."""
    if tuple(int(part) for part in jax.__version__.split(".")[:2]) < (0, 11):
        return None
    return mosaic_gpu_interpreter()


@pytest.mark.parametrize(
    "gated,num_tokens,in_dim,inter_dim,rank,num_rows,runs,entry_slots,k_splits",
    [
        (True, 256, 128, 256, 16, 200, 6, 1, 1),
        (True, 384, 128, 384, 32, 200, 9, 1, 1),
        (True, 512, 128, 640, 64, 100, 4, 1, 1),
        (False, 256, 128, 256, 16, 256, 6, 1, 1),
        (False, 256, 128, 256, 16, 256, 23, 2, 1),
        (True, 256, 128, 256, 16, 256, 23, 2, 1),
        (False, 384, 128, 256, 16, 384, 31, 3, 1),
        (False, 384, 384, 256, 16, 300, 31, 2, 2),
        (False, 256, 768, 256, 16, 256, 7, 2, 4),
    ],
    ids=[
        "gated-rank-16",
        "gated-rank-32-one-padding-tile",
        "gated-rank-64-three-padding-tiles",
        "packed-rank-16",
        "packed-ring-of-2",
        "gated-ring-of-2",
        "packed-ring-of-3",
        "packed-ring-of-2-k-in-2-parts",
        "packed-ring-of-2-k-in-4-parts",
    ],
)
def test_the_lora_kernel_in_the_mosaic_gpu_interpreter(
    gated, num_tokens, in_dim, inter_dim, rank, num_rows, runs, entry_slots, k_splits
):
    """The kernel call with LoRA entries (`lora_kernel_call`, as gemm_lora_gpu_entries makes it) run by the
    interpreter on 3 "SMs" over layer 1 of the stacks, against `gemm_lora_entries_ref` on the same operands: gated,
    each warpgroup's half of the rows adds gate's and up's entries before the activation, and the padding's row
    tiles are zeroed (the interpreter fills unwritten output with NaN); packed, [gate | up] as two parts. With a ring
    of entry slots, row tiles of many entries (more than the slots, and counts that are not multiples of them).
    With the K loop in parts, the float32 parts' sum: each part adds its own slice of a row tile's entries, so the
    sum holds each entry once (in 2 parts slices longer than the ring; in 4, slices of one entry and empty ones)."""
    interpret = interpreter_with_transposed_operands()
    if interpret is None:
        pytest.skip("this JAX's Mosaic GPU interpreter cannot run the LoRA loop's transposed B operand")
    x, w, lora_bs, s, table = gated_operands(22, num_tokens, in_dim, inter_dim, rank, runs)
    out_itemsize = 2 if k_splits == 1 else 4
    tiles = choose_gemm_lora_tiles(rank, out_itemsize=out_itemsize, gated=gated, entry_slots=entry_slots)
    assert tiles.entry_slots == entry_slots
    assert k_splits == 1 or in_dim // tiles.tile_k == k_splits * tiles.stages  # parts as choose_k_splits makes them
    per_tile = np.diff(np.asarray(table.entry_start))
    assert entry_slots == 1 or (per_tile.max() > entry_slots and (per_tile % entry_slots).any())
    tile_part, tile_part_col = part_tile_tables((inter_dim, inter_dim), tiles.tile_n if gated else 2 * tiles.tile_n)
    entry_slot = table.entry_slot + lora_bs[0].shape[1]  # layer 1's slots of the flattened [L * A, I, R] stacks
    operands = (
        x,
        w.reshape(-1, w.shape[-1]),
        jnp.array([in_dim], jnp.int32),
        jnp.array([num_rows], jnp.int32),
        jnp.asarray(tile_part),
        jnp.asarray(tile_part_col),
        table.entry_start,
        entry_slot,
        entry_s_parts(s, table, 2),
        tuple(b.reshape(-1, *b.shape[-2:]) for b in lora_bs),
    )
    options = dict(tiles=tiles, num_sms=3, gated=gated, k_splits=k_splits, interpret=interpret)
    y = np.asarray(jax.jit(lambda *ops: lora_kernel_call(*ops, **options))(*operands), np.float32)
    y = y.reshape(k_splits, num_tokens, -1).sum(axis=0)
    packed = gemm_lora_entries_ref(*operands[:3], *operands[4:], tile_m=128)
    no_lora = gemm_lora_entries_ref(*operands[:3], *operands[4:8], operands[8] * 0, operands[9], tile_m=128)
    want, want_no_lora = (np.asarray(silu_and_mul(v) if gated else v, np.float32) for v in (packed, no_lora))
    scale = np.abs(want[:num_rows]).max()
    assert y.shape == want.shape and not np.isnan(y).any()
    assert np.abs(y[:num_rows] - want[:num_rows]).max() <= 1e-2 * scale
    assert np.abs(want_no_lora[:num_rows] - want[:num_rows]).max() > 0.2 * scale  # the entries matter
    if gated:
        assert not y[-(-num_rows // 128) * 128 :].any()


def test_gated_with_lora_lowers_for_cuda(monkeypatch):
    """The gated kernel with LoRA entries at Llama-3-8B's gate|up (4096 -> 2 x 14336, 512 rows, rank 16), lowered for
    CUDA as a Hopper GPU with 132 SMs would run it: the body through Pallas' Mosaic GPU lowering; [T, I] bf16."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    num_tokens, (in_dim, out_dim), rank, num_entries = 512, LLAMA3_8B_MODULES["gate_up"], 16, 36
    i32 = jnp.int32
    shapes = (
        jax.ShapeDtypeStruct((num_tokens, in_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((2 * in_dim, out_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1,), i32),
        jax.ShapeDtypeStruct((1,), i32),
        jax.ShapeDtypeStruct((out_dim // 128,), i32),
        jax.ShapeDtypeStruct((out_dim // 128,), i32),
        jax.ShapeDtypeStruct((num_tokens // 128 + 1,), i32),
        jax.ShapeDtypeStruct((num_entries,), i32),
        jax.ShapeDtypeStruct((2 * num_entries, 128, rank), jnp.bfloat16),
        (jax.ShapeDtypeStruct((66, out_dim // 2, rank), jnp.bfloat16),) * 2,
    )
    tiles = choose_gemm_lora_tiles(rank, gated=True)
    lowered = gemm_lora_gpu_entries.trace(*shapes, tiles=tiles, gated=True).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (num_tokens, out_dim // 2) and lowered.out_info.dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("num_tokens,num_rows,runs", [(2048, 2048, 40), (512, 369, 32), (1024, 751, 32)])
def test_gated_with_lora_matches_reference_at_llama3_8b_gate_up(num_tokens, num_rows, runs):
    """gate|up of Llama-3-8B (4096 -> 2 x 14336) with rank-16 entries of 32 adapters, layer 1 of the stacks read in
    place: silu(gate) * up of the packed product within bf16 rounding on the real rows, the padding's row tiles
    zero, and the entries' share not negligible."""
    in_dim, out_dim = LLAMA3_8B_MODULES["gate_up"]
    x, w, lora_bs, s, table = gated_operands(23, num_tokens, in_dim, out_dim // 2, 16, runs, num_slots=33)
    x = x * 0.5
    rows = jnp.full((1,), num_rows, jnp.int32)
    y = gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), rows, gated=True)
    y = np.asarray(y, np.float32)
    want = np.asarray(
        silu_and_mul(gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), rows, reference=True)), np.float32
    )
    no_lora = np.asarray(
        silu_and_mul(gemm_lora_gpu(x, w, s * 0, table, lora_bs, jnp.int32(1), rows, reference=True)), np.float32
    )
    scale = np.abs(want[:num_rows]).max()
    assert y.shape == (num_tokens, out_dim // 2)
    assert np.abs(y[:num_rows] - want[:num_rows]).max() <= 1e-2 * scale
    assert np.abs(no_lora[:num_rows] - want[:num_rows]).max() > 0.1 * scale
    assert not y[-(-num_rows // 128) * 128 :].any()


def test_zero_padding_false_leaves_the_padding_rows_to_the_consumer(monkeypatch):
    """The reference: by default zero from num_rows on; zero_padding=False returns every row's product with its
    entries (as the kernel returns its skipped rows unwritten); gated zero from num_rows on either way. The kernel
    path, traced as on a GPU: the select after the kernel is left out with zero_padding=False."""
    x, w, lora_bs, s, table = gated_operands(23, 256, 128, 256, 16, 5)
    rows = jnp.array([200], jnp.int32)
    call = lambda **kw: np.asarray(  # noqa: E731
        gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(1), reference=True, **kw), np.float32
    )
    full, kept, zeroed = call(), call(num_rows=rows, zero_padding=False), call(num_rows=rows)
    np.testing.assert_array_equal(kept, full)
    assert full[200:].any()
    np.testing.assert_array_equal(zeroed[:200], full[:200])
    assert not zeroed[200:].any()
    gated = call(num_rows=rows, gated=True, zero_padding=False)
    np.testing.assert_array_equal(gated, call(num_rows=rows, gated=True))
    assert not gated[200:].any()

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    for zero_padding in (True, False):
        traced = lambda x, zero_padding=zero_padding: gemm_lora_gpu(  # noqa: E731
            x, w, s, table, lora_bs, jnp.int32(1), rows, zero_padding=zero_padding
        )
        jaxpr = jax.make_jaxpr(traced)(x)
        assert kernel_output_is_returned(jaxpr, "gemm_lora_gpu_entries") == (not zero_padding), zero_padding
