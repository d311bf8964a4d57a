"""SGMV Pallas kernels (TPU Mosaic and GPU Triton) against their pure-JAX reference.

On CPU both kernels run in interpret mode (TPU: `pltpu.InterpretParams`, GPU: `interpret=True`); tests
marked `gpu` run the Triton kernel for real and are skipped without CUDA. The `tpu_export` test lowers the real TPU
kernels with jax.export on CPU (Pallas accepts them for Mosaic); the `tpu_compile` test goes on to compile them with
libtpu for a TPU slice it describes on this host (no TPU needed; skipped where libtpu is not installed), so
Mosaic's passes (layouts, alignment, VMEM) run over them at a real model's sizes as on a TPU host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.sgmv.gpu import choose_tiles, sgmv_expand_gpu, sgmv_shrink_gpu_partials
from pallas_kernels.sgmv.reference import sgmv_expand_ref, sgmv_shrink_ref, token_slot_from_segments
from pallas_kernels.sgmv.tpu import expand_weights_view, sgmv_expand_tpu, sgmv_shrink_tpu
from pallas_kernels.sgmv.work_list import make_work_list, padded_perm
from sgl_jax_lora.lora.backend.pallas_gpu import prepare_on_host
from sgl_jax_lora.lora.lora_batch import LoRABatch, build_lora_batch
from sgl_jax_lora.model_executor.tpu_aot import compile_for_tpu, mosaic_kernels, tpu_slice_devices
from tests.support.model_export import has_libtpu

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

# Max |out - ref| allowed, relative to max |ref|, per input dtype. bf16: inputs are bf16 and the expand
# kernels round s to bf16 before the matmul (as every backend does), ~2^-8 relative per element.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

HAS_CUDA = any(d.platform == "gpu" for d in jax.devices()) if jax.default_backend() == "gpu" else False


@dataclasses.dataclass
class Case:
    x: jax.Array  # [T, in]
    lora_a: jax.Array  # [A, R, in]
    lora_b: jax.Array  # [A, out, R]
    lora: LoRABatch

    @property
    def meta(self) -> tuple[jax.Array, ...]:
        return (self.lora.sort_perm, self.lora.seg_start, self.lora.seg_slot, self.lora.slot_rank)


def make_case(
    seed: int,
    *,
    num_tokens: int = 40,
    in_dim: int = 256,
    out_dim: int = 256,
    max_rank: int = 64,
    slot_ranks: tuple[int, ...] = (0, 4, 8, 16, 64, 64),
    num_segments: int = 8,
    dtype=jnp.float32,
    all_base: bool = False,
) -> Case:
    """Random batch: tokens on random slots (slot 0 = base), slot weights zero above each slot's rank."""
    rng = np.random.default_rng(seed)
    num_slots = len(slot_ranks)
    ranks = np.array(slot_ranks, np.int32)
    token_slot = np.zeros(num_tokens, np.int32) if all_base else rng.integers(0, num_slots, num_tokens).astype(np.int32)
    row = np.arange(max_rank)
    lora_a = rng.standard_normal((num_slots, max_rank, in_dim)) * (row[None, :, None] < ranks[:, None, None])
    lora_b = rng.standard_normal((num_slots, out_dim, max_rank)) * (row[None, None, :] < ranks[:, None, None])
    scale = np.where(ranks > 0, 2.0 / np.maximum(ranks, 1), 0.0).astype(np.float32)
    lora = build_lora_batch(token_slot, num_segments, scale, ranks)
    lora = jax.tree_util.tree_map(jnp.asarray, lora)
    x = rng.standard_normal((num_tokens, in_dim))
    return Case(jnp.asarray(x, dtype), jnp.asarray(lora_a, dtype), jnp.asarray(lora_b, dtype), lora)


def assert_close(out: jax.Array, ref: jax.Array, dtype) -> None:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    tol = TOLERANCE[dtype]
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def run_kernels(
    kernel: str, case: Case, s: jax.Array, out_dtype, *, interpret: bool, rank_block: int | None = -1
) -> tuple[jax.Array, jax.Array]:
    """(shrink [T, R] f32, expand [T, out]) of one kernel family; rank_block -1 means R."""
    rank_block = case.lora_a.shape[1] if rank_block == -1 else rank_block
    if kernel == "tpu":
        shrink = sgmv_shrink_tpu(
            case.x, case.lora_a, *case.meta, rank_block=rank_block, block_rows=16, block_in=128, interpret=interpret
        )
        lora_b, rank_major = expand_weights_view(case.lora_b)  # as the backend hands B over
        expand = sgmv_expand_tpu(
            s,
            lora_b,
            *case.meta,
            out_dtype=out_dtype,
            rank_major=rank_major,
            block_rows=16,
            block_out=128,
            interpret=interpret,
        )
        return shrink, expand
    num_tokens, in_dim = case.x.shape
    # as the backend calls it: A's rank rows bound the shrink's `in` block (rank 64 at in 256: two 128-column steps)
    tiles = choose_tiles(
        num_tokens, case.lora.num_segments, in_dim, case.lora_b.shape[1], shrink_rank=case.lora_a.shape[1]
    )
    partials = sgmv_shrink_gpu_partials(
        case.x, case.lora_a, *case.meta, tiles=tiles, rank_block=rank_block, interpret=interpret
    )
    shrink = partials.sum(0)
    expand = sgmv_expand_gpu(s, case.lora_b, *case.meta, out_dtype=out_dtype, tiles=tiles, interpret=interpret)
    return shrink, expand


def check_against_reference(kernel: str, case: Case, *, interpret: bool = True) -> None:
    dtype = case.x.dtype.type
    s_ref = sgmv_shrink_ref(case.x, case.lora_a, *case.meta, rank_block=case.lora_a.shape[1])
    y_ref = sgmv_expand_ref(s_ref, case.lora_b, *case.meta, case.x.dtype)
    shrink, expand = run_kernels(kernel, case, s_ref, case.x.dtype, interpret=interpret)
    assert shrink.dtype == jnp.float32 and expand.dtype == case.x.dtype
    assert_close(shrink, s_ref, dtype)
    assert_close(expand, y_ref, dtype)
    is_base = np.asarray(case.lora.token_slot) == 0
    assert np.all(np.asarray(shrink)[is_base] == 0.0), "base rows must be exactly zero"
    assert np.all(np.asarray(expand, np.float32)[is_base] == 0.0), "base rows must be exactly zero"


KERNELS = ["tpu", "gpu"]


def test_work_list_covers_every_row_once():
    lora = make_case(0, num_tokens=37, num_segments=8).lora
    work = make_work_list(lora.seg_start, lora.seg_slot, lora.slot_rank, 37, 8)
    assert work.num_items == 5 + 8 - 1
    covered = np.zeros(40, np.int32)
    for tile, lo, hi in zip(np.asarray(work.tile), np.asarray(work.row_lo), np.asarray(work.row_hi)):
        rows = np.arange(tile * 8, tile * 8 + 8)
        covered[rows[(rows >= lo) & (rows < hi)]] += 1
    assert np.all(covered[:37] == 1) and np.all(covered[37:] == 0)
    assert np.all(np.diff(np.asarray(work.tile)) >= 0), "items of one tile must be consecutive"


@pytest.mark.parametrize(
    "num_tokens,num_segments,block_rows,num_slots",
    [(37, 8, 8, 6), (64, 32, 16, 6), (1, 4, 16, 6), (300, 16, 32, 6), (16, 1, 16, 1)],
)
def test_host_work_list_matches_jit(num_tokens, num_segments, block_rows, num_slots):
    lora = build_lora_batch(
        np.random.default_rng(num_tokens).integers(0, num_slots, num_tokens),
        num_segments,
        np.ones(6, np.float32),
        np.array([0, 4, 8, 16, 64, 64], np.int32),
    )
    host = prepare_on_host(lora, block_rows)  # the GPU backend's metadata, built with numpy
    jitted = make_work_list(
        *(jnp.asarray(a) for a in (lora.seg_start, lora.seg_slot, lora.slot_rank)), num_tokens, block_rows
    )
    for field in ("tile", "slot", "row_lo", "row_hi", "rank", "is_first"):
        assert np.array_equal(getattr(host.work, field), np.asarray(getattr(jitted, field))), field
    assert np.array_equal(host.work_perm, np.asarray(padded_perm(jnp.asarray(lora.sort_perm), block_rows, jnp)))
    assert host.work_perm.shape[0] % block_rows == 0 and host.work_block_rows == block_rows


def test_reference_recovers_token_slots():
    case = make_case(1)
    assert np.array_equal(np.asarray(token_slot_from_segments(*case.meta[:3])), np.asarray(case.lora.token_slot))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_mixed_ranks_and_empty_segments(kernel, dtype):
    # pool rank 64, slot ranks {0, 4, 8, 16, 64}; G=8 segments with at most 6 used -> empty tail segments
    check_against_reference(kernel, make_case(2, dtype=dtype))


@pytest.mark.parametrize("max_rank", [4, 8])
@pytest.mark.parametrize("kernel", KERNELS)
def test_small_rank_pool(kernel, max_rank):
    check_against_reference(kernel, make_case(3, max_rank=max_rank, slot_ranks=(0, max_rank, max_rank // 2)))


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_token(kernel):
    check_against_reference(kernel, make_case(4, num_tokens=1, slot_ranks=(0, 16), max_rank=16, num_segments=4))


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_rows_of_many_adapters(kernel):
    # a decode bucket of 200 rows over 32 adapters and base rows: a few rows per adapter, 16-row GPU tiles
    check_against_reference(
        kernel, make_case(11, num_tokens=200, max_rank=16, slot_ranks=(0,) + (16, 8) * 16, num_segments=33)
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_all_base_batch_is_exactly_zero(kernel):
    case = make_case(5, all_base=True)
    s = jnp.ones((case.x.shape[0], case.lora_a.shape[1]), jnp.float32)
    shrink, expand = run_kernels(kernel, case, s, case.x.dtype, interpret=True)
    assert np.all(np.asarray(shrink) == 0.0) and np.all(np.asarray(expand) == 0.0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_a_masks_rank_per_block(kernel):
    # q|k|v packed: A stacks 3 blocks of R=16 rows; slot ranks 4/8/16 apply inside every block
    case = make_case(10, max_rank=16, slot_ranks=(0, 4, 8, 16))
    packed_a = jnp.concatenate([case.lora_a, case.lora_a * 2.0, case.lora_a * -1.0], axis=1)  # [A, 48, in]
    # garbage above each rank inside every block must be ignored when rank_block is given
    rank = np.asarray(case.lora.slot_rank)
    above = (np.arange(48)[None, :] % 16 >= rank[:, None])[:, :, None]
    noisy_a = jnp.where(above, 7.0, packed_a)
    packed = dataclasses.replace(case, lora_a=noisy_a)
    s_ref = sgmv_shrink_ref(case.x, packed_a, *case.meta)  # clean A: no masking needed
    shrink, _ = run_kernels(kernel, packed, s_ref[:, :16], jnp.float32, interpret=True, rank_block=16)
    assert_close(shrink, s_ref, jnp.float32)
    assert np.abs(np.asarray(shrink)[:, 16:]).max() > 0, "blocks above the first must not be masked away"


@pytest.mark.parametrize("max_rank", [8, 16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_any_projection_size(kernel, max_rank):
    # in 40 and out 72, multiples of neither the GPU blocks (16+) nor the TPU lanes (128): the GPU kernels mask
    # past them, the TPU kernels pad to 128 and slice back
    case = make_case(15, in_dim=40, out_dim=72, max_rank=max_rank, slot_ranks=(0, max_rank, max_rank // 2))
    check_against_reference(kernel, case)


@pytest.mark.parametrize("kernel", KERNELS)
def test_odd_sizes_of_a_layer_stack(kernel):
    # the model's [L, A, ...] stacks at odd sizes: each kernel reads exactly the given layer (the TPU wrapper pads
    # that layer's slice, never the whole stack)
    case = make_case(16, in_dim=40, out_dim=24, max_rank=8, slot_ranks=(0, 8, 4))
    s_ref = sgmv_shrink_ref(case.x, case.lora_a, *case.meta, rank_block=8)
    y_ref = sgmv_expand_ref(s_ref, case.lora_b, *case.meta, jnp.float32)
    a_stack = jnp.stack([case.lora_a * 3.0, case.lora_a, case.lora_a - 1.0])
    b_stack = jnp.stack([case.lora_b * 3.0, case.lora_b, case.lora_b - 1.0])
    layer = jnp.int32(1)
    if kernel == "tpu":
        shrink = sgmv_shrink_tpu(case.x, a_stack, *case.meta, layer, rank_block=8, block_rows=16, interpret=True)
        b_view, rank_major = expand_weights_view(b_stack)  # rank 8: [L, A, R, out], `out` padded in lanes
        assert rank_major
        expand = sgmv_expand_tpu(
            s_ref,
            b_view,
            *case.meta,
            layer,
            out_dtype=jnp.float32,
            rank_major=rank_major,
            block_rows=16,
            interpret=True,
        )
    else:
        tiles = choose_tiles(case.x.shape[0], case.lora.num_segments, 40, 24)
        shrink = sgmv_shrink_gpu_partials(
            case.x, a_stack, *case.meta, layer=layer, tiles=tiles, rank_block=8, interpret=True
        ).sum(0)
        expand = sgmv_expand_gpu(
            s_ref, b_stack, *case.meta, layer=layer, out_dtype=jnp.float32, tiles=tiles, interpret=True
        )
    assert_close(shrink, s_ref, jnp.float32)
    assert_close(expand, y_ref, jnp.float32)


@pytest.mark.parametrize("max_rank", [16, 128])
def test_tpu_expand_reads_b_in_either_layout(max_rank):
    # B as given ([A, out, R]) and transposed ([A, R, out], how the TPU holds a rank under 128 lanes): one result
    case = make_case(20, max_rank=max_rank, slot_ranks=(0, max_rank, max_rank // 2, 4))
    s_ref = sgmv_shrink_ref(case.x, case.lora_a, *case.meta)
    y_ref = sgmv_expand_ref(s_ref, case.lora_b, *case.meta, jnp.float32)
    assert expand_weights_view(case.lora_b)[1] == (max_rank % 128 != 0)
    for lora_b, rank_major in ((case.lora_b, False), (jnp.swapaxes(case.lora_b, 1, 2), True)):
        expand = sgmv_expand_tpu(
            s_ref,
            lora_b,
            *case.meta,
            out_dtype=jnp.float32,
            rank_major=rank_major,
            block_rows=16,
            block_out=128,
            interpret=True,
        )
        assert_close(expand, y_ref, jnp.float32)


@pytest.mark.tpu_export
def test_tpu_kernels_at_odd_sizes_lower_for_tpu():
    # interpret mode does not check block shapes against Mosaic's rules; lowering for TPU (on CPU) does
    case = make_case(19, in_dim=40, out_dim=72, max_rank=8, slot_ranks=(0, 8, 4), dtype=jnp.bfloat16)

    def shrink_expand(x, a_stack, b_stack, meta, layer):
        s = sgmv_shrink_tpu(x, a_stack, *meta, layer, rank_block=8)
        b_view, rank_major = expand_weights_view(b_stack)
        return sgmv_expand_tpu(s, b_view, *meta, layer, out_dtype=x.dtype, rank_major=rank_major)

    stacks = (jnp.stack([case.lora_a] * 2), jnp.stack([case.lora_b] * 2))
    exported = jax.export.export(jax.jit(shrink_expand), platforms=["tpu"])(case.x, *stacks, case.meta, jnp.int32(1))
    assert exported.mlir_module().count("tpu_custom_call") == 2
    assert exported.out_avals[0].shape == (40, 72)


# Llama-3-8B's LoRA target modules, (in, out): q_proj and o_proj, k_proj and v_proj (8 kv heads of 128), gate_proj
# and up_proj, down_proj; at ranks 8, 16, 64 and 128 (B read transposed below 128, as given at 128), in the decode and
# mixed token buckets. Each module, rank and bucket appears in some case, not their product: a compile at 512 tokens
# takes up to ten seconds.
LLAMA3_8B_MODULES = {"q_o": (4096, 4096), "k_v": (4096, 1024), "gate_up": (4096, 14336), "down": (14336, 4096)}
SGMV_COMPILE_CASES = [
    ("q_o", 8, 64),
    ("k_v", 16, 512),
    ("gate_up", 64, 512),
    ("gate_up", 16, 64),
    ("down", 64, 64),
    ("q_o", 128, 64),
]


@pytest.mark.tpu_compile
@pytest.mark.skipif(not has_libtpu(), reason="libtpu is not installed: pip install -e '.[test]' on Linux x86_64")
@pytest.mark.parametrize(
    "module,rank,num_tokens", SGMV_COMPILE_CASES, ids=[f"{m}-rank{r}-tokens{t}" for m, r, t in SGMV_COMPILE_CASES]
)
def test_tpu_kernels_compile_for_tpu(module: str, rank: int, num_tokens: int):
    """libtpu compiles the shrink and expand kernels as the Pallas TPU backend calls them (default blocks, the
    model's layer-stacked bf16 buffers, the layer scalar-prefetched) at Llama-3-8B's projection sizes on one v5e
    chip: Mosaic's passes, which exporting does not run. The kernels read the stacks in the layouts the TPU holds
    them in: the program copies neither (a B of rank under 128 read as [.., out, R] was copied whole into a
    lane-padded layout)."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    num_layers, num_slots, num_segments = 2, 5, 6
    device = tpu_slice_devices("v5e:2x2")[0]
    one_chip = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one_chip)  # noqa: E731
    meta = (
        spec((num_tokens,), jnp.int32),  # sort_perm
        spec((num_segments + 1,), jnp.int32),  # seg_start
        spec((num_segments,), jnp.int32),  # seg_slot
        spec((num_slots,), jnp.int32),  # slot_rank
    )

    def shrink_expand(x, a_stack, b_stack, meta, layer):
        s = sgmv_shrink_tpu(x, a_stack, *meta, layer, rank_block=rank)
        b_view, rank_major = expand_weights_view(b_stack)
        return sgmv_expand_tpu(s, b_view, *meta, layer, out_dtype=x.dtype, rank_major=rank_major)

    lowered = jax.jit(shrink_expand).lower(
        spec((num_tokens, in_dim), jnp.bfloat16),
        spec((num_layers, num_slots, rank, in_dim), jnp.bfloat16),
        spec((num_layers, num_slots, out_dim, rank), jnp.bfloat16),
        meta,
        spec((), jnp.int32),
    )
    compiled = compile_for_tpu(lowered)
    assert mosaic_kernels(compiled) == 2
    stack = f"[{num_layers},{num_slots},"
    copies = [line for line in compiled.as_text().splitlines() if " copy(" in line and stack in line]
    assert not copies, copies[:2]


def test_gpu_tiles_for_odd_sizes_mask_their_last_block():
    tiles = choose_tiles(40, 8, 40, (48, 24, 24))
    assert tiles.block_in == 64 and tiles.in_splits == 1  # one masked step over `in`
    assert tiles.block_out == 64 and tiles.out_steps == 1  # one masked block per part
    assert choose_tiles(40, 8, 4104, None).block_in == 256  # 17 steps, the last one masked
    aligned = choose_tiles(40, 8, 4096, (4096, 1024, 1024))
    assert aligned.block_in == 256 and all(w % aligned.block_out == 0 for w in (4096, 1024, 1024))


def test_gpu_shrink_in_block_narrows_with_the_rank():
    # the A tile [rank rounded up to a power of two, `in` block] stays within 64 x 128 elements
    assert choose_tiles(147, 33, 4096, None, shrink_rank=16).block_in == 256
    assert choose_tiles(147, 33, 4096, None, shrink_rank=32).block_in == 256
    assert choose_tiles(147, 33, 4096, None, shrink_rank=48).block_in == 128  # q|k|v at rank 16
    assert choose_tiles(147, 33, 4096, None, shrink_rank=256).block_in == 32
    assert choose_tiles(40, 8, 4104, None, shrink_rank=64).block_in == 128  # 33 steps, the last one masked


@pytest.mark.parametrize("widths", [(48, 24, 24), (8,)], ids=["qkv_48_24_24", "part_8"])
def test_gpu_expand_odd_parts_into_packed_columns(widths):
    # one launch over every part, each part's last block masked past its width: the delta lands in its own
    # columns of the packed output and never spills into the next part's
    case = make_case(17, in_dim=40, out_dim=48, max_rank=16, slot_ranks=(0, 8, 16))
    num_tokens = case.x.shape[0]
    parts_b = tuple(case.lora_b[:, :w] * (i + 1.0) for i, w in enumerate(widths))
    s_parts = [sgmv_shrink_ref(case.x, case.lora_a * (i + 1.0), *case.meta) for i in range(len(widths))]
    base = jnp.asarray(np.random.default_rng(18).standard_normal((num_tokens, sum(widths))), jnp.float32)
    tiles = choose_tiles(num_tokens, case.lora.num_segments, None, widths)
    y = sgmv_expand_gpu(
        jnp.concatenate(s_parts, axis=1),
        parts_b,
        *case.meta,
        case.lora.slot_scale,
        base,
        out_dtype=jnp.float32,
        tiles=tiles,
        interpret=True,
    )
    scale_tok = case.lora.slot_scale[case.lora.token_slot][:, None]
    deltas = [sgmv_expand_ref(s_i * scale_tok, b, *case.meta, jnp.float32) for s_i, b in zip(s_parts, parts_b)]
    assert_close(y, base + jnp.concatenate(deltas, axis=1), jnp.float32)
    is_base = np.asarray(case.lora.token_slot) == 0
    assert np.array_equal(np.asarray(y)[is_base], np.asarray(base)[is_base]), "base rows must be untouched"


def test_gpu_expand_fuses_scale_and_base_add():
    case = make_case(6)
    num_tokens = case.x.shape[0]
    s_ref = sgmv_shrink_ref(case.x, case.lora_a, *case.meta)
    scale_tok = case.lora.slot_scale[case.lora.token_slot][:, None]
    base = jnp.asarray(np.random.default_rng(7).standard_normal((num_tokens, case.lora_b.shape[1])), jnp.float32)
    y_ref = base + sgmv_expand_ref(s_ref * scale_tok, case.lora_b, *case.meta, jnp.float32)
    tiles = choose_tiles(num_tokens, case.lora.num_segments, None, case.lora_b.shape[1])
    # the shrink partials of several `in` splits are summed inside the expand kernel
    partials = jnp.stack([s_ref * 0.25, s_ref * 0.75])
    y = sgmv_expand_gpu(
        partials,
        case.lora_b,
        *case.meta,
        case.lora.slot_scale,
        base,
        out_dtype=jnp.float32,
        tiles=tiles,
        interpret=True,
    )
    assert_close(y, y_ref, jnp.float32)
    is_base = np.asarray(case.lora.token_slot) == 0
    assert np.array_equal(np.asarray(y)[is_base], np.asarray(base)[is_base]), "base rows must be untouched"


def test_gpu_expand_into_packed_columns_with_host_work_list():
    # q|k|v style: one stacked shrink result [T, 3R], each part's expand reads its R columns of s and adds into
    # its own columns of one packed output; the step's host-built work list replaces the in-jit one
    case = make_case(11, max_rank=16, slot_ranks=(0, 4, 8, 16))
    num_tokens = case.x.shape[0]
    rng = np.random.default_rng(12)
    parts_b = [case.lora_b, case.lora_b[:, :128] * 0.5, case.lora_b[:, :128] * -2.0]
    s_parts = [sgmv_shrink_ref(case.x, case.lora_a * k, *case.meta) for k in (1.0, 3.0, -1.0)]
    s_packed = jnp.concatenate(s_parts, axis=1)  # [T, 48]
    widths = [b.shape[1] for b in parts_b]
    base = jnp.asarray(rng.standard_normal((num_tokens, sum(widths))), jnp.float32)
    tiles = choose_tiles(num_tokens, case.lora.num_segments, None, 128)
    host_lora = build_lora_batch(
        np.asarray(case.lora.token_slot),
        case.lora.num_segments,
        np.asarray(case.lora.slot_scale),
        np.asarray(case.lora.slot_rank),
    )
    host = prepare_on_host(host_lora, tiles.block_rows)
    y, col = base, 0
    for i, part_b in enumerate(parts_b):
        y = sgmv_expand_gpu(
            s_packed,
            part_b,
            *case.meta,
            case.lora.slot_scale,
            y,
            host.work,
            host.work_perm,
            out_dtype=jnp.float32,
            tiles=tiles,
            s_col=16 * i,
            out_col=col,
            interpret=True,
        )
        col += part_b.shape[1]
    scale_tok = case.lora.slot_scale[case.lora.token_slot][:, None]
    deltas = [sgmv_expand_ref(s_i * scale_tok, b, *case.meta, jnp.float32) for s_i, b in zip(s_parts, parts_b)]
    assert_close(y, base + jnp.concatenate(deltas, axis=1), jnp.float32)
    is_base = np.asarray(case.lora.token_slot) == 0
    assert np.array_equal(np.asarray(y)[is_base], np.asarray(base)[is_base]), "base rows must be untouched"
    with pytest.raises(ValueError, match="do not fit"):
        sgmv_expand_gpu(
            s_packed,
            parts_b[0],
            *case.meta,
            None,
            base,
            out_dtype=jnp.float32,
            tiles=tiles,
            out_col=sum(widths) - 64,
            interpret=True,
        )


def test_gpu_kernels_read_one_layer_of_stacks_and_expand_all_parts_in_one_launch():
    # the engine passes [L, A, ...] stacks and the layer index (no per-layer copy of the pool), and a packed
    # module's parts go through one expand launch; B columns at or above the rank rounded up to the 8-column
    # granule are never read (NaN there would leak into the sum), the zeros below it are the pool's guarantee
    case = make_case(13, max_rank=16, slot_ranks=(0, 4, 8, 16))
    num_tokens = case.x.shape[0]
    rank = np.asarray(case.lora.slot_rank)
    granule_end = -(-rank // 8) * 8
    parts_b = [case.lora_b, case.lora_b[:, :128] * 0.5]
    noisy_b = [jnp.where(np.arange(16)[None, None, :] >= granule_end[:, None, None], jnp.nan, b) for b in parts_b]
    packed_a = jnp.concatenate([case.lora_a, case.lora_a * -2.0], axis=1)  # [A, 32, in]
    layer, num_layers = 1, 3

    def stack(w):
        return jnp.stack([w if i == layer else w * 3.0 + 1.0 for i in range(num_layers)])

    tiles = choose_tiles(num_tokens, case.lora.num_segments, case.x.shape[1], tuple(b.shape[1] for b in parts_b))
    partials = sgmv_shrink_gpu_partials(
        case.x, stack(packed_a), *case.meta, layer=jnp.int32(layer), tiles=tiles, rank_block=16, interpret=True
    )
    s_ref = sgmv_shrink_ref(case.x, packed_a, *case.meta, rank_block=16)
    assert_close(partials.sum(0), s_ref, jnp.float32)
    base = jnp.asarray(np.random.default_rng(14).standard_normal((num_tokens, 384)), jnp.float32)
    y = sgmv_expand_gpu(
        partials,
        tuple(stack(b) for b in noisy_b),
        *case.meta,
        case.lora.slot_scale,
        base,
        layer=jnp.int32(layer),
        out_dtype=jnp.float32,
        tiles=tiles,
        interpret=True,
    )
    scale_tok = case.lora.slot_scale[case.lora.token_slot][:, None]
    deltas = [
        sgmv_expand_ref(s_ref[:, 16 * i : 16 * (i + 1)] * scale_tok, b, *case.meta, jnp.float32)
        for i, b in enumerate(parts_b)
    ]
    assert_close(y, base + jnp.concatenate(deltas, axis=1), jnp.float32)
    with pytest.raises(ValueError, match="needs `layer`"):
        sgmv_shrink_gpu_partials(case.x, stack(packed_a), *case.meta, tiles=tiles, rank_block=16, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(num_tokens=40),
        dict(num_tokens=1, max_rank=16, slot_ranks=(0, 16), num_segments=4),
        dict(num_tokens=300, in_dim=512, out_dim=768, num_segments=16),
        dict(num_tokens=200, max_rank=16, slot_ranks=(0,) + (16, 8) * 16, num_segments=33),
        dict(num_tokens=2048, in_dim=1024, out_dim=512, max_rank=16, slot_ranks=(0, 8, 16, 16, 16), num_segments=8),
        dict(num_tokens=64, max_rank=8, slot_ranks=(0, 8, 4)),
        dict(num_tokens=300, in_dim=40, out_dim=72, max_rank=8, slot_ranks=(0, 8, 4)),
        dict(num_tokens=40, in_dim=4104, out_dim=88, max_rank=16, slot_ranks=(0, 16, 8)),
    ],
    ids=["t40", "t1", "t300", "t200_33_segments", "t2048", "r8", "odd_in40_out72", "odd_in4104_out88"],
)
def test_gpu_kernel_on_device(shape, dtype):
    check_against_reference("gpu", make_case(8, dtype=dtype, **shape), interpret=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_all_base_on_device():
    case = make_case(9, all_base=True, dtype=jnp.bfloat16)
    s = jnp.ones((case.x.shape[0], case.lora_a.shape[1]), jnp.float32)
    shrink, expand = run_kernels("gpu", case, s, case.x.dtype, interpret=False)
    assert np.all(np.asarray(shrink) == 0.0) and np.all(np.asarray(expand, np.float32) == 0.0)
