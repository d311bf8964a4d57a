"""Every LoRA backend against the pure-JAX reference, unsharded and sharded over 8 fake CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.sgmv.reference import sgmv_expand_ref, sgmv_shrink_ref
from pallas_kernels.sgmv.work_list import gpu_block_rows
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import pack_parts, split_packed
from sgl_jax_lora.lora.backend import BACKEND_NAMES, LoRABackend, make_lora_backend
from sgl_jax_lora.lora.backend.auto import AutoBackend, choose_backend_name
from sgl_jax_lora.lora.backend.base import LoRAMeta
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas import make_pallas_backend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend, PallasGPUMeta, prepare_on_host
from sgl_jax_lora.lora.backend.pallas_tpu import PallasTPUBackend
from sgl_jax_lora.lora.backend.sgmv import SgmvBackend
from sgl_jax_lora.lora.lora_batch import LoRABatch, build_lora_batch
from tests.support.lora_backends import apply, expand, resolved, shrink

# Max |out - ref| relative to max |ref|, per dtype. bf16: bf16 inputs/outputs and s rounded to bf16 before
# the expand matmul (every backend does this), ~2^-8 relative per element.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

BACKENDS = {
    "einsum": lambda mesh: EinsumBackend(mesh),
    "bgmv": lambda mesh: BgmvBackend(mesh),
    "sgmv_ragged": lambda mesh: SgmvBackend(mesh, method="ragged"),
    "sgmv_onehot": lambda mesh: SgmvBackend(mesh, method="segment_onehot"),
    "pallas_gpu": lambda mesh: PallasGPUBackend(mesh, interpret=True),
    "pallas_tpu": lambda mesh: PallasTPUBackend(mesh, interpret=True),
    "auto": lambda mesh: AutoBackend(mesh),
}


def make_inputs(
    seed,
    *,
    num_tokens=32,
    in_dim=256,
    out_dim=256,
    max_rank=64,
    slot_ranks=(0, 4, 8, 16, 64),
    num_segments=8,
    dtype=jnp.float32,
    all_base=False,
):
    rng = np.random.default_rng(seed)
    ranks = np.array(slot_ranks, np.int32)
    num_slots = len(ranks)
    token_slot = np.zeros(num_tokens, np.int32) if all_base else rng.integers(0, num_slots, num_tokens).astype(np.int32)
    row = np.arange(max_rank)
    lora_a = rng.standard_normal((num_slots, max_rank, in_dim)) * (row[None, :, None] < ranks[:, None, None])
    lora_b = rng.standard_normal((num_slots, out_dim, max_rank)) * (row[None, None, :] < ranks[:, None, None])
    scale = np.where(ranks > 0, 2.0 / np.maximum(ranks, 1), 0.0).astype(np.float32)
    lora = jax.tree_util.tree_map(jnp.asarray, build_lora_batch(token_slot, num_segments, scale, ranks))
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), dtype)
    return x, jnp.asarray(lora_a, dtype), jnp.asarray(lora_b, dtype), lora


def reference(x, lora_a, lora_b, lora: LoRABatch):
    meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    s = sgmv_shrink_ref(x, lora_a, *meta)
    y = sgmv_expand_ref(s * lora.slot_scale[lora.token_slot][:, None], lora_b, *meta, x.dtype)
    return s, y


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(float(np.abs(ref).max()), 1.0))


def check_backend(backend: LoRABackend, inputs, dtype):
    x, lora_a, lora_b, lora = inputs
    s_ref, y_ref = reference(*inputs)
    s = shrink(backend, x, lora_a, lora)
    assert s.dtype == jnp.float32
    assert_close(s, s_ref, dtype)
    y_expand = expand(backend, s_ref, lora_b, lora, out_dtype=x.dtype)
    assert y_expand.dtype == x.dtype
    assert_close(
        y_expand,
        sgmv_expand_ref(s_ref, lora_b, lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank, x.dtype),
        dtype,
    )
    y = apply(backend, x, lora_a, lora_b, lora)
    assert y.dtype == x.dtype
    assert_close(y, y_ref, dtype)
    is_base = np.asarray(lora.token_slot) == 0
    assert np.all(np.asarray(s)[is_base] == 0.0) and np.all(np.asarray(y, np.float32)[is_base] == 0.0)
    base_out = jnp.full((x.shape[0], lora_b.shape[1]), 0.5, x.dtype)
    y_fused = apply(backend, x, lora_a, lora_b, lora, base_out=base_out)
    assert_close(y_fused, np.asarray(y_ref, np.float32) + 0.5, dtype)
    assert np.all(np.asarray(y_fused, np.float32)[is_base] == 0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_mixed_ranks_and_empty_segments(name, dtype):
    # ranks {4, 8, 16, 64} in a rank-64 pool, base tokens, and G=8 segments of which at most 5 are used
    check_backend(BACKENDS[name](None), make_inputs(0, dtype=dtype), dtype)


@pytest.mark.parametrize("poison", [np.nan, np.inf, 3e38], ids=["nan", "inf", "huge"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_poisoned_slot_changes_no_other_slots_tokens(name, poison):
    # slot 2's A and B hold NaN / Inf / values that overflow to Inf (as an adapter that skipped the loader's
    # finiteness check would): every token of the other slots, base included, still gets exactly its clean result
    x, lora_a, lora_b, lora = make_inputs(3, num_tokens=24, max_rank=16, slot_ranks=(0, 4, 8, 16), num_segments=4)
    _, y_clean = reference(x, lora_a, lora_b, lora)
    poisoned_a = lora_a.at[2, 0, :7].set(poison)
    poisoned_b = lora_b.at[2, :5, 0].set(poison)
    base_out = jnp.full((x.shape[0], lora_b.shape[1]), 0.5, x.dtype)
    y = np.asarray(apply(BACKENDS[name](None), x, poisoned_a, poisoned_b, lora, base_out=base_out))
    others = np.asarray(lora.token_slot) != 2
    assert others.sum() > 0 and (~others).sum() > 0
    assert np.all(np.isfinite(y[others]))
    assert_close(y[others], np.asarray(y_clean)[others] + 0.5, jnp.float32)


# The Pallas backends run their kernels in interpret mode here (slow); tests/pallas_kernels/sgmv/test_sgmv_kernels.py
# already checks those kernels on small pools, one token and all-base batches, so they skip the repeats below.
PURE_JAX = ["einsum", "bgmv", "sgmv_ragged", "sgmv_onehot", "auto"]


@pytest.mark.parametrize("max_rank", [4, 8])
@pytest.mark.parametrize("name", PURE_JAX)
def test_small_rank_pool(name, max_rank):
    inputs = make_inputs(1, max_rank=max_rank, slot_ranks=(0, max_rank, max_rank // 2))
    check_backend(BACKENDS[name](None), inputs, jnp.float32)


@pytest.mark.parametrize("name", PURE_JAX + ["pallas_gpu"])
def test_one_token(name):
    inputs = make_inputs(2, num_tokens=1, max_rank=16, slot_ranks=(0, 16), num_segments=4)
    check_backend(BACKENDS[name](None), inputs, jnp.float32)


@pytest.mark.parametrize("name", PURE_JAX + ["pallas_gpu"])
def test_all_base_batch(name):
    x, lora_a, lora_b, lora = make_inputs(3, all_base=True)
    y = apply(BACKENDS[name](None), x, lora_a, lora_b, lora)
    assert np.all(np.asarray(y) == 0.0)


def packed_inputs(seed, *, num_tokens, dtype, block_rows=0, in_dim=128, widths=(256, 128, 128)):
    """q|k|v-like packed module: A of the parts stacked along R, parts of different widths; its LoRA metadata."""
    rng = np.random.default_rng(seed)
    ranks = np.array((0, 4, 8, 16), np.int32)
    max_rank, num_parts = 16, len(widths)
    row = np.arange(num_parts * max_rank) % max_rank
    lora_a = rng.standard_normal((4, num_parts * max_rank, in_dim)) * (row[None, :, None] < ranks[:, None, None])
    lora_bs = tuple(
        jnp.asarray(
            rng.standard_normal((4, w, max_rank)) * (np.arange(max_rank)[None, None, :] < ranks[:, None, None]), dtype
        )
        for w in widths
    )
    token_slot = rng.integers(0, 4, num_tokens).astype(np.int32)
    scale = np.where(ranks > 0, 2.0 / np.maximum(ranks, 1), 0.0).astype(np.float32)
    lora = build_lora_batch(token_slot, 4, scale, ranks)
    # block_rows: the Pallas GPU kernels' work list built on the host; else the kernels build theirs in jit
    meta = jax.tree_util.tree_map(jnp.asarray, prepare_on_host(lora, block_rows) if block_rows else LoRAMeta(lora))
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), dtype)
    base_out = jnp.asarray(rng.standard_normal((num_tokens, sum(widths))), dtype)
    return x, jnp.asarray(lora_a, dtype), lora_bs, meta, base_out


@pytest.mark.parametrize("block_rows", [0, 16], ids=["jit_work_list", "host_work_list"])
@pytest.mark.parametrize("name", PURE_JAX + ["pallas_gpu", "pallas_tpu"])
def test_apply_packed_adds_every_part_in_place(name, block_rows):
    if block_rows and not name.startswith("pallas"):
        pytest.skip("only the Pallas GPU kernels read the host work list")
    dtype = jnp.float32
    x, lora_a, lora_bs, meta, base_out = packed_inputs(5, num_tokens=24, dtype=dtype, block_rows=block_rows)
    lora = meta.batch
    segments = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    s = sgmv_shrink_ref(x, lora_a, *segments, rank_block=16) * lora.slot_scale[lora.token_slot][:, None]
    deltas = [sgmv_expand_ref(s[:, 16 * i : 16 * (i + 1)], b, *segments, dtype) for i, b in enumerate(lora_bs)]
    y = BACKENDS[name](None).apply_packed(x, lora_a, lora_bs, meta, base_out, tp_size=1)
    assert y.dtype == base_out.dtype
    assert_close(y, base_out + jnp.concatenate(deltas, axis=1), dtype)
    is_base = np.asarray(lora.token_slot) == 0
    assert np.array_equal(np.asarray(y)[is_base], np.asarray(base_out)[is_base]), "base rows must be untouched"


@pytest.mark.parametrize("in_place", [False, True], ids=["delta", "in_place"])
def test_pallas_gpu_apply_packed_delta_and_in_place_agree(in_place):
    # column-parallel modules (q|k|v, gate|up) return the delta for XLA to add, so the expand runs beside the base
    # GEMM; the in-place expand (row-parallel modules into the residual) must give the same base_out + delta, base
    # rows untouched
    backend = PallasGPUBackend(None, interpret=True)
    assert backend.returns_delta(input_sharded=False)
    assert not backend.returns_delta(input_sharded=True)  # row-parallel: into the residual
    assert not PallasTPUBackend(None, interpret=True).returns_delta(input_sharded=False)
    if in_place:
        backend.returns_delta = lambda input_sharded: False
    x, lora_a, lora_bs, meta, base_out = packed_inputs(12, num_tokens=24, dtype=jnp.float32, block_rows=16)
    assert backend.returns_delta(input_sharded=False) != in_place
    y = jax.jit(lambda *a: backend.apply_packed(*a, tp_size=1))(x, lora_a, lora_bs, meta, base_out)
    expected = EinsumBackend(None).apply_packed(x, lora_a, lora_bs, meta, base_out, tp_size=1)
    assert_close(y, expected, jnp.float32)
    is_base = np.asarray(meta.batch.token_slot) == 0
    assert np.array_equal(np.asarray(y)[is_base], np.asarray(base_out)[is_base]), "base rows must be untouched"


def stack_layers(weights: jax.Array, num_layers: int, layer: int) -> jax.Array:
    """[L, ...] stack whose layer `layer` is `weights` and whose other layers are different (scaled) copies."""
    return jnp.stack([weights if i == layer else weights * (i + 2.0) for i in range(num_layers)])


@pytest.mark.parametrize("name", ["pallas_gpu", "pallas_tpu", "bgmv", "auto"])
def test_apply_packed_reads_one_layer_of_stacked_buffers(name):
    # the model's layer loop hands LoRALinear LayerStack views; backends that read stacks in place (the Pallas
    # GPU and TPU kernels) must pick exactly layer `layer`, the others get the layer's slice: both equal the
    # unstacked call
    x, lora_a, lora_bs, lora, base_out = packed_inputs(7, num_tokens=24, dtype=jnp.float32, block_rows=16)
    backend = BACKENDS[name](None)
    expected = backend.apply_packed(x, lora_a, lora_bs, lora, base_out, tp_size=1)
    chosen = resolved(backend, 24, lora.batch, 512)
    layer = jnp.int32(2)
    a_view = LayerStack(stack_layers(lora_a, 4, 2), layer)
    b_views = tuple(LayerStack(stack_layers(b, 4, 2), layer) for b in lora_bs)
    assert chosen.reads_stacked == name.startswith("pallas")

    @jax.jit
    def run(x, a_view, b_views, lora, base_out):
        if not chosen.reads_stacked:  # slicing here or in the backend is the same
            return backend.apply_packed(
                x, a_view.sliced(), tuple(b.sliced() for b in b_views), lora, base_out, tp_size=1
            )
        return backend.apply_packed(x, a_view, b_views, lora, base_out, tp_size=1)

    assert_close(run(x, a_view, b_views, lora, base_out), expected, jnp.float32)


@pytest.mark.parametrize("widths", [(48, 24, 24), (8,)], ids=["qkv_48_24_24", "part_8"])
@pytest.mark.parametrize("name", ["pallas_gpu", "pallas_tpu"])
def test_apply_packed_any_projection_size(name, widths):
    # `in` 40 and part widths that neither the GPU blocks nor the TPU lanes divide, read from layer stacks as the
    # model passes them: the same result as the one-hot einsum on the layer's slice, base rows untouched
    x, lora_a, lora_bs, lora, base_out = packed_inputs(
        13, num_tokens=24, dtype=jnp.float32, block_rows=16, in_dim=40, widths=widths
    )
    expected = EinsumBackend(None).apply_packed(x, lora_a, lora_bs, lora, base_out, tp_size=1)
    backend = BACKENDS[name](None)
    layer = jnp.int32(1)
    a_view = LayerStack(stack_layers(lora_a, 3, 1), layer)
    b_views = tuple(LayerStack(stack_layers(b, 3, 1), layer) for b in lora_bs)
    y = jax.jit(lambda *a: backend.apply_packed(*a, tp_size=1))(x, a_view, b_views, lora, base_out)
    assert_close(y, expected, jnp.float32)
    is_base = np.asarray(lora.batch.token_slot) == 0
    assert np.array_equal(np.asarray(y)[is_base], np.asarray(base_out)[is_base]), "base rows must be untouched"


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA device")
@pytest.mark.parametrize("widths", [(256, 128, 128), (48, 24, 24)], ids=["aligned", "odd"])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_pallas_apply_packed_on_device(num_tokens, widths):
    dtype = jnp.bfloat16
    x, lora_a, lora_bs, lora, base_out = packed_inputs(
        6,
        num_tokens=num_tokens,
        dtype=dtype,
        block_rows=gpu_block_rows(num_tokens),
        in_dim=128 if widths[0] == 256 else 40,
        widths=widths,
    )
    expected = EinsumBackend(None).apply_packed(x, lora_a, lora_bs, lora, base_out, tp_size=1)
    y = jax.jit(lambda *a: make_pallas_backend(None).apply_packed(*a, tp_size=1))(x, lora_a, lora_bs, lora, base_out)
    assert_close(y, expected, dtype)


SHARDED_BACKENDS = ["einsum", "bgmv", "sgmv_ragged", "sgmv_onehot", "pallas_gpu"]


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    # Auto axes: the engine's jitted model relies on GSPMD propagation
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("layer", ["column", "row"])
@pytest.mark.parametrize("name", SHARDED_BACKENDS)
def test_sharded_matches_unsharded(mesh, name, layer):
    x, lora_a, lora_b, lora = make_inputs(4, num_tokens=24, max_rank=16, slot_ranks=(0, 4, 16, 16))
    _, y_ref = reference(x, lora_a, lora_b, lora)
    backend = BACKENDS[name](mesh)
    is_row = layer == "row"

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    x_s = put(x, P(None, "tensor") if is_row else P())
    a_s = put(lora_a, P(None, None, "tensor") if is_row else P())
    b_s = put(lora_b, P() if is_row else P(None, "tensor", None))
    lora_s = jax.tree_util.tree_map(lambda v: put(v, P()), lora)

    @jax.jit
    def run(x, lora_a, lora_b, lora):
        s = shrink(backend, x, lora_a, lora, input_sharded=is_row)
        s = s * lora.slot_scale[lora.token_slot][:, None]
        y_two_step = expand(backend, s, lora_b, lora, output_sharded=not is_row, out_dtype=x.dtype)
        y_fused = apply(backend, x, lora_a, lora_b, lora, input_sharded=is_row, output_sharded=not is_row)
        return y_two_step, y_fused

    for y in run(x_s, a_s, b_s, lora_s):
        assert_close(y, y_ref, jnp.float32)


@pytest.mark.parametrize("layer", ["column", "row"])
@pytest.mark.parametrize("name", ["pallas_gpu", "bgmv"])
def test_apply_packed_sharded_matches_unsharded(mesh, name, layer):
    # tp 4: the Pallas GPU kernels read the [L, A, ...] stacks (split like the per-layer buffers, with the
    # layer axis whole; the TPU kernels share this shard_map path but need 128-multiple local dims, too slow
    # to interpret here); bgmv gets the layer's slices
    x, lora_a, lora_bs, lora, base_out = packed_inputs(8, num_tokens=24, dtype=jnp.float32, block_rows=16)
    lora_bs = lora_bs[:1] if layer == "row" else lora_bs  # a row-parallel module has one part
    base_out = base_out[:, : sum(b.shape[1] for b in lora_bs)]
    is_row = layer == "row"
    expected = EinsumBackend(None).apply_packed(x, lora_a, lora_bs, lora, base_out, tp_size=1)
    backend = BACKENDS[name](mesh)

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    a_stack = put(stack_layers(lora_a, 3, 1), P(None, None, None, "tensor") if is_row else P())
    b_stacks = tuple(put(stack_layers(b, 3, 1), P() if is_row else P(None, None, "tensor", None)) for b in lora_bs)
    x_s = put(x, P(None, "tensor") if is_row else P())
    y_spec = P() if is_row else P(None, "tensor")
    # a column-parallel packed output is shard-major over tp (layers/linear.py)
    base_s = put(base_out if is_row else pack_parts(split_columns(base_out, lora_bs), 4), y_spec)
    lora_s = jax.tree_util.tree_map(lambda v: put(v, P()), lora)

    @jax.jit
    def run(x, a_stack, b_stacks, lora, base_out):
        layer_index = jnp.int32(1)
        a, bs = LayerStack(a_stack, layer_index), tuple(LayerStack(b, layer_index) for b in b_stacks)
        if not resolved(backend, 24, lora.batch, base_out.shape[1]).reads_stacked:
            a, bs = a.sliced(), tuple(b.sliced() for b in bs)
        return backend.apply_packed(
            x, a, bs, lora, base_out, tp_size=4, input_sharded=is_row, output_sharded=not is_row
        )

    y = run(x_s, a_stack, b_stacks, lora_s, base_s)
    if not is_row:
        y = jnp.concatenate(split_packed(y, tuple(b.shape[1] for b in lora_bs), 4), axis=1)
    assert_close(y, expected, jnp.float32)


def split_columns(y: jax.Array, lora_bs) -> list[jax.Array]:
    widths = np.cumsum([b.shape[1] for b in lora_bs])[:-1]
    return jnp.split(y, widths, axis=1)


def test_factory_names_and_errors():
    for name in BACKEND_NAMES:
        assert make_lora_backend(name).name == name
    with pytest.raises(ValueError, match="unknown --lora-backend"):
        make_lora_backend("nope")


def test_auto_choice_is_static_per_bucket():
    assert choose_backend_name("cpu", 64, 32) == "einsum"  # no measurements off GPU
    assert choose_backend_name("tpu", 8192, 4) == "einsum"
    measured = {
        (1, 1): "sgmv",
        (1, 8): "bgmv",
        (64, 32): "pallas",
        (256, 1): "sgmv",
        (256, 128): "pallas",
        (2048, 4): "sgmv",
        (4096, 32): "pallas",
        (8192, 4): "pallas",
    }
    for (tokens, segments), name in measured.items():
        assert choose_backend_name("gpu", tokens, segments) == name
    # decode buckets of 17-64 tokens: every module on the Pallas kernels, whatever the adapter count or width;
    # the smallest buckets stay on bgmv
    for segments, width in [(4, 4096), (8, 4096), (33, 6144), (33, 28672)]:
        assert choose_backend_name("gpu", 64, segments, width) == "pallas"
    assert choose_backend_name("gpu", 16, 8, 28672) == "bgmv"
    assert choose_backend_name("gpu", 16, 4, 4096) == "bgmv"
    auto = AutoBackend(None)
    auto.platform = "gpu"  # the table, not the machine: which tile the engine builds and what LoRALinear passes
    assert work_block_rows(auto, 64, 32) == gpu_block_rows(64)
    assert work_block_rows(auto, 16, 8) == 0
    assert auto.chosen(64, 32, 28672).reads_stacked and auto.chosen(64, 32, 4096).reads_stacked
    assert not auto.chosen(16, 8, 4096).reads_stacked


def work_block_rows(backend, num_tokens: int, num_segments: int) -> int:
    """The row tile of the work list in the metadata `backend.prepare` builds for a bucket (0: none)."""
    lora = build_lora_batch(np.zeros(num_tokens, np.int32), num_segments, np.zeros(4, np.float32), np.zeros(4))
    meta = backend.prepare(jax.tree_util.tree_map(jnp.asarray, lora), num_seqs=num_tokens)
    return meta.work_block_rows if isinstance(meta, PallasGPUMeta) else 0


def test_delta_holding_input_sharded_matches_unsharded(mesh):
    # q|k|v-like at tp 4 (the Pallas GPU backend's shrink-first path, LoRALinear's column-parallel call): the delta
    # in the packed shard-major layout, and x handed back unchanged for the base GEMM
    x, lora_a, lora_bs, lora, base_out = packed_inputs(8, num_tokens=24, dtype=jnp.float32, block_rows=16)
    expected = EinsumBackend(None).apply_packed(x, lora_a, lora_bs, lora, jnp.zeros_like(base_out), tp_size=1)
    backend = BACKENDS["pallas_gpu"](mesh)

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    a_stack = put(stack_layers(lora_a, 3, 1), P())
    b_stacks = tuple(put(stack_layers(b, 3, 1), P(None, None, "tensor", None)) for b in lora_bs)
    lora_s = jax.tree_util.tree_map(lambda v: put(v, P()), lora)

    @jax.jit
    def run(x, a_stack, b_stacks, lora):
        a, bs = LayerStack(a_stack, jnp.int32(1)), tuple(LayerStack(b, jnp.int32(1)) for b in b_stacks)
        return backend.delta_holding_input(x, a, bs, lora, tp_size=4)

    delta, held = run(put(x, P()), a_stack, b_stacks, lora_s)
    delta = jnp.concatenate(split_packed(delta, tuple(b.shape[1] for b in lora_bs), 4), axis=1)
    assert_close(delta, expected, jnp.float32)
    np.testing.assert_array_equal(np.asarray(held), np.asarray(x))
    assert backend.delta_holding_input(x, lora_a, lora_bs, lora, tp_size=1) is not None
    backend.shrink_first = False
    assert backend.delta_holding_input(x, lora_a, lora_bs, lora, tp_size=1) is None
