"""TPU ragged paged attention kernel (pallas_kernels/attention/tpu.py) against its reference.

The kernel runs on CPU in Mosaic interpret mode (`pltpu.InterpretParams`: uninitialized VMEM reads as NaN and
out-of-bounds DMAs raise). Page-table entries a sequence does not use hold an out-of-range page id for the kernel
(the reference gets page 0 there), so a kernel that DMAs a page it should not read fails; with a sliding window the
pages below each sequence's first window hold it too.

The `tpu_export` tests lower the real (non-interpret) kernel for TPU with jax.export on CPU: proof that Pallas
accepts it for Mosaic. The `tpu_compile` tests go on to compile it with libtpu for a TPU slice that libtpu describes
on this host (no TPU needed; skipped where libtpu is not installed), so Mosaic's passes (layouts, alignment, VMEM)
run over it as on a TPU host, for the shapes the engine hands it. Nothing runs on a TPU: the numbers are checked in
interpret mode only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.attention.reference import ragged_paged_attention_ref
from pallas_kernels.attention.tpu import ragged_paged_attention_tpu
from pallas_kernels.attention.tpu_layout import plan_ragged_attention_tpu
from sgl_jax_lora.model_executor.tpu_aot import compile_for_tpu, mosaic_kernels, tpu_slice_devices
from tests.support.model_export import has_libtpu

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
_UNUSED_PAGE = 1 << 20  # far past any cache in these tests: reading it is an out-of-bounds DMA


@dataclasses.dataclass(frozen=True)
class Case:
    """One call. Shapes come in buckets as in the engine (T, S, P, pages), so cases share compiles; the rows
    past the real ones are padding: tokens past cu_q_lens[S], sequences with q_len 0 and kv_len 0."""

    q_lens: tuple[int, ...]  # per real sequence
    kv_lens: tuple[int, ...]  # per real sequence, this step's tokens included
    num_tokens: int = 32  # T, padding included
    num_seqs: int = 8  # S, padding sequences included
    pages_per_seq: int = 16  # P
    num_pages: int = 64  # cache pages, scratch page 0 included
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 4
    num_layers: int = 2
    layer: int = 1
    queries_per_block: int | None = 4
    kv_pages_per_block: int | None = 2
    dtype: type = jnp.float32
    cache_dtype: type | None = None  # default: dtype; an 8-bit float is --kv-cache-dtype fp8_*
    sliding_window: int | None = None  # the keys a query attends to; None: all up to its own


@dataclasses.dataclass(frozen=True)
class Inputs:
    q: jax.Array  # [T, H, D]
    k_cache: jax.Array  # [L, K, N, D]
    v_cache: jax.Array  # [L, K, N, D]
    kv_lens: jax.Array  # [S] i32
    page_table: jax.Array  # [S, P] i32, unused entries = _UNUSED_PAGE
    page_table_ref: jax.Array  # [S, P] i32, unused entries = 0 (the scratch page)
    cu_q_lens: jax.Array  # [S+1] i32


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)
    num_padding_seqs = case.num_seqs - len(case.q_lens)
    q_lens = list(case.q_lens) + [0] * num_padding_seqs
    kv_lens = list(case.kv_lens) + [0] * num_padding_seqs
    pages_needed = [-(-kv // case.page_size) for kv in kv_lens]
    assert sum(q_lens) <= case.num_tokens and max(pages_needed) <= case.pages_per_seq, "case outgrows its bucket"
    free_pages = rng.permutation(np.arange(1, case.num_pages))  # page 0 is scratch
    page_table = np.full((case.num_seqs, case.pages_per_seq), _UNUSED_PAGE, np.int32)
    taken = 0
    for seq, count in enumerate(pages_needed):
        page_table[seq, :count] = free_pages[taken : taken + count]
        taken += count
    page_table_ref = np.where(page_table == _UNUSED_PAGE, 0, page_table)
    if case.sliding_window is not None:  # pages wholly below every query's window: the kernel must not read them
        for seq, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            lowest_key = max(kv_len - q_len - case.sliding_window + 1, 0)  # the window's of the first query
            page_table[seq, : lowest_key // case.page_size] = _UNUSED_PAGE
    cache_shape = (case.num_layers, case.num_kv_heads, case.num_pages * case.page_size, case.head_dim)
    draw = lambda shape, dtype=case.dtype: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return Inputs(
        q=draw((case.num_tokens, case.num_heads, case.head_dim)),
        k_cache=draw(cache_shape, case.cache_dtype or case.dtype),
        v_cache=draw(cache_shape, case.cache_dtype or case.dtype),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        page_table=jnp.asarray(page_table),
        page_table_ref=jnp.asarray(page_table_ref),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )


def run_both(case: Case, inputs: Inputs) -> tuple[np.ndarray, np.ndarray]:
    scale = case.head_dim**-0.5
    window = None if case.sliding_window is None else jnp.int32(case.sliding_window)
    common = (inputs.q, inputs.k_cache, inputs.v_cache, jnp.int32(case.layer), inputs.kv_lens)
    out = ragged_paged_attention_tpu(
        *common,
        inputs.page_table,
        inputs.cu_q_lens,
        page_size=case.page_size,
        scale=scale,
        num_kv_pages_per_block=case.kv_pages_per_block,
        num_queries_per_block=case.queries_per_block,
        interpret=True,
        sliding_window=window,
    )
    ref = ragged_paged_attention_ref(
        *common, inputs.page_table_ref, inputs.cu_q_lens, page_size=case.page_size, scale=scale, sliding_window=window
    )
    return np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))


def check_case(case: Case) -> None:
    inputs = make_inputs(case)
    out, ref = run_both(case, inputs)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    num_real = int(inputs.cu_q_lens[-1])
    assert not np.any(out[num_real:]), "padding tokens must give zeros"
    assert np.all(np.isfinite(out)), "stale VMEM (NaN in interpret mode) leaked into the output"


CASES = {
    "decode_rows_only": Case(q_lens=(1,) * 6, kv_lens=(5, 1, 17, 8, 12, 3)),
    "prefill_chunks_only": Case(q_lens=(7, 12, 3), kv_lens=(7, 12, 3)),
    "mixed_decode_and_chunks": Case(q_lens=(1, 9, 1, 1, 6), kv_lens=(30, 9, 4, 13, 6)),
    "chunks_after_cached_prefix": Case(q_lens=(5, 11), kv_lens=(21, 40)),
    "lengths_on_page_boundaries": Case(q_lens=(4, 8, 1, 1), kv_lens=(4, 16, 8, 1)),
    "long_chunk_split_over_q_blocks": Case(q_lens=(1, 27, 1), kv_lens=(3, 45, 9)),
    "empty_seqs_between_real_ones": Case(q_lens=(3, 0, 1, 0, 2), kv_lens=(3, 7, 9, 0, 5)),
    "no_padding_full_buckets": Case(q_lens=(1, 1, 9, 1, 1, 16, 1, 2), kv_lens=(2, 3, 9, 20, 5, 30, 7, 2)),
    "gqa_ratio_1": Case(q_lens=(1, 5, 1), kv_lens=(13, 5, 2), num_heads=2, num_kv_heads=2),
    "gqa_ratio_4": Case(q_lens=(1, 5, 1), kv_lens=(13, 9, 2), num_heads=8, num_kv_heads=2),
    "gqa_ratio_8": Case(q_lens=(2, 1), kv_lens=(11, 6), num_heads=8, num_kv_heads=1),
    "first_layer_of_three": Case(q_lens=(1, 4), kv_lens=(9, 6), num_layers=3, layer=0),
    "last_layer_of_three": Case(q_lens=(1, 4), kv_lens=(9, 6), num_layers=3, layer=2),
    "page_size_8_head_dim_24": Case(q_lens=(3, 1), kv_lens=(19, 33), page_size=8, head_dim=24),
    "kv_block_not_dividing_page_table": Case(q_lens=(2, 1), kv_lens=(22, 9), pages_per_seq=6, kv_pages_per_block=4),
    "q_and_kv_blocks_of_8": Case(q_lens=(1, 27, 1), kv_lens=(3, 45, 9), queries_per_block=8, kv_pages_per_block=8),
    "contexts_of_a_few_hundred": Case(
        q_lens=(1, 16, 1),
        kv_lens=(300, 260, 177),
        page_size=16,
        pages_per_seq=20,
        kv_pages_per_block=4,
        queries_per_block=8,
        num_kv_heads=1,
        num_heads=2,
    ),
    "default_block_sizes": Case(q_lens=(1, 7, 1), kv_lens=(20, 7, 31), queries_per_block=None, kv_pages_per_block=None),
    "bf16": Case(q_lens=(1, 6, 1), kv_lens=(14, 9, 3), dtype=jnp.bfloat16),
    # 8-bit caches are widened to q's dtype in the kernel: float32 products of the same values as the reference's
    "fp8_e4m3_cache": Case(q_lens=(1, 6, 1), kv_lens=(14, 9, 3), cache_dtype=jnp.float8_e4m3fn),
    "fp8_e5m2_cache_bf16": Case(q_lens=(1, 6, 1), kv_lens=(14, 9, 3), dtype=jnp.bfloat16, cache_dtype=jnp.float8_e5m2),
    # sliding windows (Mistral's, Qwen2's): of one key, inside a page, across the 8-key kv blocks, wider than
    # every context; the pages below each sequence's first window hold an out-of-range page index
    "window_of_one_key": Case(q_lens=(1, 9, 1, 1, 6), kv_lens=(30, 9, 4, 13, 6), sliding_window=1),
    "window_inside_a_page": Case(q_lens=(1, 9, 1, 1, 6), kv_lens=(30, 9, 4, 13, 6), sliding_window=3),
    "window_across_kv_blocks": Case(q_lens=(1, 27, 1), kv_lens=(3, 45, 9), sliding_window=11),
    "window_past_every_context": Case(q_lens=(5, 11), kv_lens=(21, 40), sliding_window=64),
    "window_fp8_e4m3_cache": Case(
        q_lens=(1, 9, 1, 1, 6), kv_lens=(30, 9, 4, 13, 6), sliding_window=5, cache_dtype=jnp.float8_e4m3fn
    ),
    "window_gqa_8_q_blocks_of_8": Case(
        q_lens=(2, 20, 1), kv_lens=(11, 50, 33), num_heads=8, num_kv_heads=1, queries_per_block=8, sliding_window=9
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name: str):
    check_case(CASES[name])


def test_context_4096():
    check_case(
        Case(
            q_lens=(1, 4),
            kv_lens=(4096, 300),
            num_tokens=8,
            num_seqs=2,
            pages_per_seq=128,
            num_pages=160,
            num_heads=2,
            num_kv_heads=1,
            page_size=32,
            kv_pages_per_block=16,
            queries_per_block=8,
        )
    )


def test_wrong_layer_would_be_caught():
    """The layer cases above mean something only if layers differ: reading layer 0 must not match layer 1."""
    case = CASES["first_layer_of_three"]
    inputs = make_inputs(case)
    out, _ = run_both(case, inputs)
    _, ref_other = run_both(dataclasses.replace(case, layer=1), inputs)
    assert np.abs(out - ref_other).max() > 1e-2


@pytest.mark.parametrize("queries_per_block", [4, None], ids=["given-q-tile", "default-q-tile"])
def test_plan_built_once_serves_every_layer(queries_per_block):
    # the model builds the step's q-block layout once and hands it to each layer's call: for every layer of the
    # cache the output is the reference's, and the same bits as a call that builds its own layout
    case = dataclasses.replace(
        CASES["long_chunk_split_over_q_blocks"],
        num_layers=3,
        num_heads=8,
        num_kv_heads=1,  # GQA 8: the default q tile is 16 tokens of the 32
        queries_per_block=queries_per_block,
    )
    inputs = make_inputs(case)
    plan = plan_ragged_attention_tpu(
        inputs.cu_q_lens,
        num_tokens=case.num_tokens,
        group=case.num_heads // case.num_kv_heads,
        q_dtype=case.dtype,
        num_queries_per_block=queries_per_block,
    )
    assert plan.block_first_seq.shape[0] > 1  # the chunk spans several q blocks
    for layer in range(case.num_layers):
        layer_case = dataclasses.replace(case, layer=layer)
        own, want = run_both(layer_case, inputs)
        planned = run_planned(layer_case, inputs, plan)
        np.testing.assert_array_equal(planned, own)
        np.testing.assert_allclose(planned, want, atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])


def test_plan_of_another_q_tile_raises():
    case = CASES["long_chunk_split_over_q_blocks"]
    inputs = make_inputs(case)
    plan = plan_ragged_attention_tpu(inputs.cu_q_lens, num_tokens=case.num_tokens, group=2, q_dtype=case.dtype)
    with pytest.raises(ValueError, match="build it with plan_ragged_attention_tpu"):
        run_planned(case, inputs, plan)  # the case's q tile of 4 tokens, the plan's of 32


def run_planned(case: Case, inputs: Inputs, plan) -> np.ndarray:
    out = ragged_paged_attention_tpu(
        inputs.q,
        inputs.k_cache,
        inputs.v_cache,
        jnp.int32(case.layer),
        inputs.kv_lens,
        inputs.page_table,
        inputs.cu_q_lens,
        page_size=case.page_size,
        scale=case.head_dim**-0.5,
        num_kv_pages_per_block=case.kv_pages_per_block,
        num_queries_per_block=case.queries_per_block,
        interpret=True,
        plan=plan,
    )
    return np.asarray(out.astype(jnp.float32))


def test_untiled_shapes_raise_outside_interpret_mode():
    case = CASES["decode_rows_only"]
    inputs = make_inputs(case)
    with pytest.raises(ValueError, match="head_dim 16 is not a multiple of 128.*--attention-backend native"):
        ragged_paged_attention_tpu(
            inputs.q,
            inputs.k_cache,
            inputs.v_cache,
            jnp.int32(0),
            inputs.kv_lens,
            inputs.page_table,
            inputs.cu_q_lens,
            page_size=case.page_size,
            scale=1.0,
        )


def test_bf16_page_size_off_the_sublane_tile_raises():
    args = _tpu_export_args(num_tokens=16, num_seqs=16, num_heads=8, num_kv_heads=8, page_size=8)
    kernel = functools.partial(ragged_paged_attention_tpu, page_size=8, scale=1.0)
    with pytest.raises(ValueError, match="page_size 8 is not a multiple of 16.*--page-size 16"):
        jax.eval_shape(kernel, *args)


def _tpu_export_args(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    page_size: int,
    cache_dtype=jnp.bfloat16,
    head_dim: int = 128,
    sharding: NamedSharding | None = None,
):
    """The kernel's positional arguments as shapes (on `sharding` when given): bf16 q, 4 layers of 2048 pages."""
    num_layers, pages_per_seq, num_pages = 4, 64, 2048
    struct = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    cache = struct((num_layers, num_kv_heads, num_pages * page_size, head_dim), cache_dtype)
    return (
        struct((num_tokens, num_heads, head_dim), jnp.bfloat16),
        cache,
        cache,
        struct((), jnp.int32),
        struct((num_seqs,), jnp.int32),
        struct((num_seqs, pages_per_seq), jnp.int32),
        struct((num_seqs + 1,), jnp.int32),
    )


@pytest.mark.tpu_export
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("num_tokens,num_seqs", [(64, 64), (512, 16)], ids=["decode", "mixed"])
def test_lowers_for_tpu(page_size: int, num_heads: int, num_kv_heads: int, num_tokens: int, num_seqs: int):
    kernel = functools.partial(ragged_paged_attention_tpu, page_size=page_size, scale=128**-0.5)
    args = _tpu_export_args(num_tokens, num_seqs, num_heads, num_kv_heads, page_size)
    exported = jax.export.export(jax.jit(kernel), platforms=["tpu"])(*args)
    module = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in module, "the kernel did not lower to a Mosaic custom call"


@pytest.mark.tpu_export
@pytest.mark.parametrize("num_tokens,num_seqs", [(64, 64), (512, 16)], ids=["decode", "mixed"])
def test_fp8_cache_lowers_for_tpu(num_tokens: int, num_seqs: int):
    # an 8-bit cache's sublane tile is 32 rows: page size 32
    kernel = functools.partial(ragged_paged_attention_tpu, page_size=32, scale=128**-0.5)
    args = _tpu_export_args(num_tokens, num_seqs, 32, 8, 32, cache_dtype=jnp.float8_e4m3fn)
    exported = jax.export.export(jax.jit(kernel), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


def test_fp8_page_size_off_the_sublane_tile_raises():
    args = _tpu_export_args(num_tokens=16, num_seqs=16, num_heads=8, num_kv_heads=8, page_size=16)
    args = (args[0], *(jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn) for a in args[1:3]), *args[3:])
    kernel = functools.partial(ragged_paged_attention_tpu, page_size=16, scale=1.0)
    with pytest.raises(ValueError, match="page_size 16 is not a multiple of 32.*--page-size 32"):
        jax.eval_shape(kernel, *args)


# The tpu_compile tests: the real kernel compiled by libtpu for one chip of a TPU slice, over what the engine can hand
# it: page sizes 16, 32 and 64; the heads of Llama-3-8B (32 query, 8 kv), Qwen2-7B (28, 4: a GQA group of 7), an
# MHA model (8, 8) and a group of 16 (16, 1); head_dim 128 and 256; the decode and mixed token buckets. Each value of
# each dimension appears in some case, not their product (a compile takes seconds).
SLICES = {"v5e": "v5e:2x2", "v6e": "v6e:2x4"}
BUCKETS = {"decode": (64, 64), "mixed": (512, 16)}  # (T, S)
LLAMA3_8B, QWEN2_7B, MHA, GROUP_16 = (32, 8), (28, 4), (8, 8), (16, 1)
needs_libtpu = pytest.mark.skipif(
    not has_libtpu(), reason="libtpu is not installed: pip install -e '.[test]' on Linux x86_64"
)

V5E_CASES = {
    "page16-llama3-decode": (16, LLAMA3_8B, 128, "decode"),
    "page32-llama3-mixed": (32, LLAMA3_8B, 128, "mixed"),
    "page32-qwen2-decode": (32, QWEN2_7B, 128, "decode"),
    "page64-qwen2-mixed": (64, QWEN2_7B, 128, "mixed"),
    "page16-mha-mixed": (16, MHA, 128, "mixed"),
    "page64-mha-d256-decode": (64, MHA, 256, "decode"),
    "page16-group16-decode": (16, GROUP_16, 128, "decode"),
    "page32-group16-d256-mixed": (32, GROUP_16, 256, "mixed"),
}
V6E_CASES = {
    "page16-llama3-mixed": (16, LLAMA3_8B, 128, "mixed"),
    "page32-qwen2-decode": (32, QWEN2_7B, 128, "decode"),
    "page64-mha-decode": (64, MHA, 128, "decode"),
    "page64-group16-d256-mixed": (64, GROUP_16, 256, "mixed"),
}
COMPILE_CASES = [pytest.param("v5e", *case, id=f"v5e-{name}") for name, case in V5E_CASES.items()]
COMPILE_CASES += [pytest.param("v6e", *case, id=f"v6e-{name}") for name, case in V6E_CASES.items()]


def _compile_for_one_chip(program, chip: str, args_of_sharding) -> jax.stages.Compiled:
    """program lowered with the shapes args_of_sharding(sharding) gives, on one chip of the slice, and compiled by
    libtpu: XLA's TPU passes and Mosaic's over the kernel, as on a TPU host."""
    device = tpu_slice_devices(SLICES[chip])[0]
    one_chip = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    return compile_for_tpu(jax.jit(program).lower(*args_of_sharding(one_chip)))


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("chip,page_size,heads,head_dim,bucket", COMPILE_CASES)
def test_compiles_for_tpu(chip: str, page_size: int, heads: tuple[int, int], head_dim: int, bucket: str):
    """Mosaic compiles the kernel at each page size, GQA group, head_dim and bucket (exporting does not run its
    layout and VMEM passes)."""
    num_tokens, num_seqs = BUCKETS[bucket]
    kernel = functools.partial(ragged_paged_attention_tpu, page_size=page_size, scale=head_dim**-0.5)
    compiled = _compile_for_one_chip(
        kernel,
        chip,
        lambda sharding: _tpu_export_args(
            num_tokens, num_seqs, *heads, page_size, head_dim=head_dim, sharding=sharding
        ),
    )
    assert mosaic_kernels(compiled) >= 1


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize(
    "chip,heads,bucket",
    [("v5e", LLAMA3_8B, "decode"), ("v5e", QWEN2_7B, "mixed"), ("v6e", GROUP_16, "mixed")],
    ids=["v5e-llama3-decode", "v5e-qwen2-mixed", "v6e-group16-mixed"],
)
def test_fp8_cache_compiles_for_tpu(chip: str, heads: tuple[int, int], bucket: str):
    """An 8-bit cache (pages of 32, its sublane tile) compiles: its slabs are widened to q's dtype in the kernel."""
    num_tokens, num_seqs = BUCKETS[bucket]
    kernel = functools.partial(ragged_paged_attention_tpu, page_size=32, scale=128**-0.5)
    compiled = _compile_for_one_chip(
        kernel,
        chip,
        lambda sharding: _tpu_export_args(
            num_tokens, num_seqs, *heads, 32, cache_dtype=jnp.float8_e4m3fn, sharding=sharding
        ),
    )
    assert mosaic_kernels(compiled) >= 1


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize(
    "page_size,heads,cache_dtype,bucket",
    [
        (16, QWEN2_7B, jnp.bfloat16, "decode"),
        (64, GROUP_16, jnp.bfloat16, "mixed"),
        (32, LLAMA3_8B, jnp.float8_e4m3fn, "mixed"),
    ],
    ids=["page16-qwen2-decode", "page64-group16-mixed", "page32-llama3-fp8-mixed"],
)
def test_sliding_window_compiles_for_tpu(page_size: int, heads: tuple[int, int], cache_dtype, bucket: str):
    """A traced sliding window (a layer's, as Qwen2's and Mistral's models pass it) compiles: the window is
    scalar-prefetched and bounds the kv blocks and page DMAs."""
    num_tokens, num_seqs = BUCKETS[bucket]

    def windowed(*args):
        *kernel_args, window = args
        return ragged_paged_attention_tpu(*kernel_args, page_size=page_size, scale=128**-0.5, sliding_window=window)

    def args_of_sharding(sharding):
        args = _tpu_export_args(num_tokens, num_seqs, *heads, page_size, cache_dtype=cache_dtype, sharding=sharding)
        return (*args, jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding))

    compiled = _compile_for_one_chip(windowed, "v5e", args_of_sharding)
    assert mosaic_kernels(compiled) >= 1


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize(
    "heads,bucket", [(LLAMA3_8B, "decode"), (QWEN2_7B, "mixed")], ids=["llama3-decode", "qwen2-mixed"]
)
def test_plan_built_once_compiles_for_tpu(heads: tuple[int, int], bucket: str):
    """The model's path: the step's q-block plan built once in the program and handed to each layer's call, every
    layer's kernel compiled."""
    num_tokens, num_seqs = BUCKETS[bucket]
    num_heads, num_kv_heads = heads
    num_layers = 4  # _tpu_export_args's cache

    def every_layer(q, k_cache, v_cache, kv_lens, page_table, cu_q_lens):
        plan = plan_ragged_attention_tpu(
            cu_q_lens, num_tokens=num_tokens, group=num_heads // num_kv_heads, q_dtype=q.dtype
        )
        kernel = functools.partial(ragged_paged_attention_tpu, page_size=16, scale=128**-0.5, plan=plan)
        return [
            kernel(q, k_cache, v_cache, jnp.int32(layer), kv_lens, page_table, cu_q_lens) for layer in range(num_layers)
        ]

    def args_of_sharding(sharding):
        q, k_cache, v_cache, _, kv_lens, page_table, cu_q_lens = _tpu_export_args(
            num_tokens, num_seqs, *heads, 16, sharding=sharding
        )
        return q, k_cache, v_cache, kv_lens, page_table, cu_q_lens

    compiled = _compile_for_one_chip(every_layer, "v5e", args_of_sharding)
    assert mosaic_kernels(compiled) == num_layers
