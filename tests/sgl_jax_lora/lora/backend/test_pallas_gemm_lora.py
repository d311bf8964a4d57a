"""Prefill with the base GEMM and the LoRA in one kernel, as the Pallas backend and the model run it
(PallasGPUBackend.apply_with_base; pallas_kernels/sgmv/gemm_lora_gpu.py).

On CPU the backend computes that path with the kernel's pure-JAX reference of the same entry layout
(`gemm_lora_entries_ref`), so what is checked here is everything around the kernel: which buckets and modules
take it, packed parts, layer stacks read in place, tensor parallelism (the row-parallel delta added on one
shard), the entry table the backend prepares per forward, and the engine's outputs against the SGMV path. On a
Hopper GPU the same tests run the Mosaic GPU kernel itself when JAX is left on the GPU (`JAX_PLATFORMS=cuda`; a plain
run of the suite keeps JAX on the CPU, tests/conftest.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sgl_jax_lora.lora.backend.pallas_gpu as pallas_module
from pallas_kernels.sgmv.gemm_gpu import gemm_gpu
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import pack_parts, split_packed
from sgl_jax_lora.lora.backend.auto import AutoBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas import make_pallas_backend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend, PallasGPUMeta, entry_table
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from tests.support.kernel_sized_engine import (
    PROMPTS,
    count_calls,
    make_kernel_sized_model_and_adapters,
    serve_logprobs,
)
from tests.support.model_fixtures import load_hf_model, make_hf_model_dir
from tests.support.peft_fixtures import load_peft_model, write_peft_adapter

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow


def module_inputs(seed, *, num_tokens=256, in_dim=128, widths=(512, 256, 256), rank=16, seq_lens=(40, 100, 60, 30)):
    """A packed module's x, W, A (parts stacked along R) and B per part, and a prefill batch of sequences whose
    tokens are contiguous (slot 0 = base, padding at the end), as backend metadata with its entry table."""
    rng = np.random.default_rng(seed)
    num_slots, num_parts = 4, len(widths)
    ranks = np.array([0, rank, rank // 2, rank], np.int32)
    row = np.arange(num_parts * rank) % rank
    lora_a = rng.standard_normal((num_slots, num_parts * rank, in_dim)) * (row[None, :, None] < ranks[:, None, None])
    lora_bs = tuple(
        jnp.asarray(rng.standard_normal((num_slots, w, rank)) * (np.arange(rank) < ranks[:, None, None]), jnp.bfloat16)
        for w in widths
    )
    seq_slots = rng.integers(0, num_slots, len(seq_lens))
    token_slot = np.zeros(num_tokens, np.int32)
    token_slot[: sum(seq_lens)] = np.repeat(seq_slots, seq_lens)
    scale = np.where(ranks > 0, 2.0, 0.0).astype(np.float32)
    lora = jax.tree_util.tree_map(jnp.asarray, build_lora_batch(token_slot, 8, scale, ranks))
    lora = PallasGPUMeta(lora, entries=entry_table(lora, 128, len(seq_lens)))
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((in_dim, sum(widths))) * 0.1, jnp.bfloat16)
    return x, w, jnp.asarray(lora_a, jnp.bfloat16), lora_bs, lora


def base_product(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def base_plus_lora(x, w, lora_a, lora_bs, lora):
    """x @ W + every part's delta, in float32, from the one-hot einsum backend."""
    base = base_product(x, w)
    return EinsumBackend(None).apply_packed(
        x.astype(jnp.float32),
        lora_a.astype(jnp.float32),
        tuple(b.astype(jnp.float32) for b in lora_bs),
        lora,
        base,
        tp_size=1,
    )


def assert_close(y, expected):
    y, expected = np.asarray(y.astype(jnp.float32)), np.asarray(expected)
    assert np.abs(y - expected).max() <= 1e-2 * np.abs(expected).max()  # bf16 output, s rounded to bf16


def fused_backend(mesh=None, gated_min_tokens=256) -> PallasGPUBackend:
    backend = PallasGPUBackend(mesh, fused_gemm_min_tokens=256)
    backend.GATED_MIN_TOKENS = gated_min_tokens
    return backend


@pytest.mark.parametrize("stacked", ["arrays", "layer_stacks", "a_too_large_for_int32_offsets"])
def test_apply_with_base_equals_base_gemm_plus_lora(stacked, monkeypatch):
    if stacked == "a_too_large_for_int32_offsets":  # the shrink then gets A's layer slice; W and B stay stacked
        monkeypatch.setattr(pallas_module, "fits_stacked_offsets", lambda shape: False)
    x, w, lora_a, lora_bs, lora = module_inputs(0)
    expected = base_plus_lora(x, w, lora_a, lora_bs, lora)
    lora_delta = expected - base_product(x, w)
    assert float(jnp.abs(lora_delta).max()) > 0.2 * float(jnp.abs(expected).max())  # the LoRA part is not negligible
    if stacked != "arrays":  # the model hands over views of [L, ...] stacks; layer 1 must be read, not its neighbours
        layer = jnp.int32(1)
        w, lora_a = LayerStack(jnp.stack([w * 3, w, w * 2]), layer), LayerStack(jnp.stack([lora_a * 3, lora_a]), layer)
        lora_bs = tuple(LayerStack(jnp.stack([b * 3, b]), layer) for b in lora_bs)
    y = jax.jit(lambda *a: fused_backend().apply_with_base(*a, tp_size=1))(x, w, lora_a, lora_bs, lora)
    assert y.shape == expected.shape and y.dtype == jnp.bfloat16
    assert_close(y, expected)
    is_base = np.asarray(lora.batch.token_slot) == 0  # base rows: x @ W alone
    assert_close(y[is_base], base_product(x, as_array(w))[is_base])


def test_by_default_only_gate_up_takes_the_fused_gemm_below_the_other_modules_threshold():
    """The default rule (here at 256 and 512 tokens, on Hopper GPUs 1024 and 2048): in a 256-token bucket the
    column-parallel module of two parts (gate|up) runs the GEMM with the LoRA inside it, a three-part one (q|k|v)
    and a row-parallel one (o, down) get None and run the base GEMM beside the SGMV kernels; from 512 every module
    does. An explicit --lora-fused-gemm-min-tokens (fused_gemm_min_tokens alone) sets both."""
    backend = PallasGPUBackend(None, fused_gemm_min_tokens=256, fused_gemm_other_min_tokens=512)
    explicit = PallasGPUBackend(None, fused_gemm_min_tokens=256)
    assert explicit.fused_gemm_other_min_tokens == 256
    qkv = module_inputs(6)
    gate_up = module_inputs(6, widths=(512, 512))
    x, w, lora_a, lora_bs, lora = gate_up
    y = jax.jit(lambda *a: backend.apply_with_base(*a, tp_size=1))(x, w, lora_a, lora_bs, lora)
    assert_close(y, base_plus_lora(x, w, lora_a, lora_bs, lora))
    assert backend.apply_with_base(*qkv, tp_size=1) is None
    assert backend.apply_with_base(*qkv, tp_size=1, input_sharded=True) is None
    assert explicit.apply_with_base(*qkv, tp_size=1) is not None
    assert [backend.takes_fused_gemm(t, 3, False) for t in (256, 512)] == [False, True]
    assert [backend.takes_fused_gemm(t, 1, True) for t in (256, 512)] == [False, True]
    assert [backend.takes_fused_gemm(t, 2, False) for t in (128, 256)] == [False, True]
    assert [backend.fused_gemm_tile_rows(t, 8) for t in (128, 256, 512)] == [0, 128, 128]


def test_packed_delta_goes_to_the_gated_epilogue_below_the_fused_gemm():
    """gate|up's delta alone (`packed_delta`) where gated_delta is on and gate|up does not take the fused GEMM: both
    parts' packed delta, and the base GEMM's gated epilogue given it (the kernel's reference here) computes silu(gate)
    * up of the product with the delta. None with gated_delta off (the default off Hopper GPUs) and in a bucket where
    gate|up takes the fused GEMM. On a GPU the SGMV kernels themselves."""
    x, w, lora_a, lora_bs, lora = module_inputs(7, widths=(256, 256))
    backend = PallasGPUBackend(None, fused_gemm_min_tokens=512, gated_delta=True)
    meta = backend.prepare(lora.batch, num_seqs=8)
    delta = jax.jit(lambda *a: backend.packed_delta(*a, tp_size=1))(x, lora_a, lora_bs, meta)
    with_lora = base_plus_lora(x, w, lora_a, lora_bs, lora)
    assert delta.shape == (256, 512) and delta.dtype == jnp.bfloat16
    assert_close(delta, with_lora - base_product(x, w))
    gate, up = jnp.split(with_lora, 2, axis=1)
    assert_close(gemm_gpu(x, w, gated=True, delta=delta, reference=True), jax.nn.silu(gate) * up)
    assert PallasGPUBackend(None).gated_delta == pallas_module._is_hopper(None)  # the default: on Hopper GPUs
    off = PallasGPUBackend(None, fused_gemm_min_tokens=512, gated_delta=False)
    assert off.packed_delta(x, lora_a, lora_bs, meta, tp_size=1) is None
    fused_here = PallasGPUBackend(None, fused_gemm_min_tokens=256, gated_delta=True)
    assert fused_here.packed_delta(x, lora_a, lora_bs, meta, tp_size=1) is None
    assert [fused_here.gives_packed_delta(t) for t in (128, 256)] == [True, False]


def as_array(w):
    return w.sliced() if isinstance(w, LayerStack) else w


def test_apply_with_base_leaves_the_padding_rows_with_zero_padding_false():
    """The bucket's padding after its 230 real tokens: zero by default; with zero_padding=False (q|k|v into the
    rotary + K/V write kernel, which masks them) as the kernel leaves them, here its reference's products of the
    padding tokens (base tokens: x @ W); the real rows the same either way."""
    x, w, lora_a, lora_bs, lora = module_inputs(2)
    rows = jnp.array([230], jnp.int32)
    run = jax.jit(
        lambda *a, zero_padding: fused_backend().apply_with_base(
            *a, tp_size=1, output_sharded=True, num_rows=rows, zero_padding=zero_padding
        ),
        static_argnames="zero_padding",
    )
    zeroed, kept = (np.asarray(run(x, w, lora_a, lora_bs, lora, zero_padding=z), np.float32) for z in (True, False))
    np.testing.assert_array_equal(kept[:230], zeroed[:230])
    assert not zeroed[230:].any() and kept[230:].any()
    assert_close(jnp.asarray(kept[230:]), base_product(x, w)[230:])


def test_gated_apply_with_base_is_the_activation_of_gate_and_up():
    """gate|up (two parts of one width): silu(gate) * up of the packed product with both parts' deltas, read from
    layer 1 of the stacks; the rows after num_rows' row tile zero. A row-parallel or three-part module is refused."""
    x, w, lora_a, lora_bs, lora = module_inputs(4, widths=(384, 384))
    gate, up = jnp.split(base_plus_lora(x, w, lora_a, lora_bs, lora), 2, axis=1)
    expected = jax.nn.silu(gate) * up
    layer = jnp.int32(1)
    w, lora_a = LayerStack(jnp.stack([w * 3, w]), layer), LayerStack(jnp.stack([lora_a * 3, lora_a]), layer)
    lora_bs = tuple(LayerStack(jnp.stack([b * 3, b]), layer) for b in lora_bs)
    rows = jnp.array([120], jnp.int32)
    backend = fused_backend()
    call = jax.jit(
        lambda x, w, a, bs, meta, rows: backend.apply_with_base(
            x, w, a, bs, meta, tp_size=1, output_sharded=True, num_rows=rows, gated=True
        )
    )
    y = call(x, w, lora_a, lora_bs, lora, rows)
    assert y.shape == (256, 384) and y.dtype == jnp.bfloat16
    assert_close(y[:120], expected[:120])
    assert not np.asarray(y[128:], np.float32).any()
    with pytest.raises(ValueError, match="column-parallel module of two parts"):
        backend.apply_with_base(x, w, lora_a, lora_bs, lora, tp_size=1, input_sharded=True, gated=True)
    # below GATED_MIN_TOKENS (the default's 2048) gate|up runs the packed product, then XLA's activation
    small_buckets = fused_backend(gated_min_tokens=PallasGPUBackend.GATED_MIN_TOKENS)
    assert (
        small_buckets.apply_with_base(x, w, lora_a, lora_bs, lora, tp_size=1, output_sharded=True, gated=True) is None
    )


def test_the_gated_kernel_takes_the_entry_ring_in_its_buckets(monkeypatch):
    """The ring of LoRA entries in flight (ENTRY_SLOTS) goes to the gated kernel too in buckets up to
    ENTRY_RING_MAX_TOKENS (by default none, the gated kernel starting at 2048 tokens; here at 256): two slots at 256
    tokens, one once the ring's bucket is below them, the result the same."""
    calls = count_calls(monkeypatch, pallas_module, "gemm_lora_gpu")
    x, w, lora_a, lora_bs, lora = module_inputs(4, widths=(384, 384))
    backend = fused_backend()
    assert PallasGPUBackend.ENTRY_RING_MAX_TOKENS < PallasGPUBackend.GATED_MIN_TOKENS
    kw = dict(tp_size=1, output_sharded=True, gated=True)
    ring = backend.apply_with_base(x, w, lora_a, lora_bs, lora, **kw)
    backend.ENTRY_RING_MAX_TOKENS = 128
    one = backend.apply_with_base(x, w, lora_a, lora_bs, lora, **kw)
    assert [call["tiles"].entry_slots for call in calls] == [PallasGPUBackend.ENTRY_SLOTS, 1]
    assert calls[0]["gated"] and calls[0]["tiles"].entry_slots > 1
    np.testing.assert_array_equal(np.asarray(ring, np.float32), np.asarray(one, np.float32))


def test_apply_with_base_splits_k_where_the_tiles_leave_sms_idle(monkeypatch):
    """With an H100's 132 SMs, a module of 8 CTA tiles cuts its K loop (8 K steps) in 2 parts, with the float32
    epilogue tiles; the result is the same module's. Off GPUs (no SM count) it stays in one part."""
    calls, kernel_call = [], pallas_module.gemm_lora_gpu

    def recording(*args, **kwargs):
        calls.append((kwargs["k_splits"], kwargs["tiles"]))
        return kernel_call(*args, **kwargs)

    monkeypatch.setattr(pallas_module, "gemm_lora_gpu", recording)
    x, w, lora_a, lora_bs, lora = module_inputs(1, in_dim=512)
    expected = base_plus_lora(x, w, lora_a, lora_bs, lora)
    on_h100, off_gpus = fused_backend(), fused_backend()
    on_h100.fused_gemm_sms, off_gpus.fused_gemm_sms = 132, 0
    assert_close(on_h100.apply_with_base(x, w, lora_a, lora_bs, lora, tp_size=1), expected)
    assert_close(off_gpus.apply_with_base(x, w, lora_a, lora_bs, lora, tp_size=1), expected)
    (split, split_tiles), (unsplit, _) = calls
    assert (split, unsplit) == (2, 1)
    assert split_tiles.epilogue_n == 32 and split_tiles.smem_bytes(16, out_itemsize=4) + 1024 <= 227 * 1024


NEEDS_TWO_DEVICES = pytest.mark.skipif(
    jax.device_count() < 2 or jax.device_count() % 2,
    reason="needs an even number of devices >= 2 (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)",
)


@NEEDS_TWO_DEVICES
@pytest.mark.parametrize("layer", ["column", "row", "gated"])
def test_apply_with_base_under_tensor_parallelism(layer):
    """tp 2: a column-parallel module splits W, B and y on `out` (each shard's parts side by side); a row-parallel
    one splits x, W and A on `in`, sums the shrink over the shards, adds the delta on the first shard only and
    all-reduces y; gate|up with the activation in the kernel gives each shard its columns of silu(gate) * up. All
    equal the one-device result."""
    is_row, gated = layer == "row", layer == "gated"
    widths = (256,) if is_row else (256, 256) if gated else (1024, 512, 512)  # per shard, parts of whole CTA tiles
    x, w, lora_a, lora_bs, lora = module_inputs(1, in_dim=256, widths=widths)
    expected = base_plus_lora(x, w, lora_a, lora_bs, lora)
    if gated:
        gate, up = jnp.split(expected, 2, axis=1)
        expected = jax.nn.silu(gate) * up
    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    if not is_row:  # the packed output is shard-major over tp (layers/linear.py)
        w = pack_parts(list(jnp.split(w, np.cumsum(widths)[:-1], axis=1)), 2)
    layer_index = jnp.int32(0)
    w_view = LayerStack(put(w[None], P(None, "tensor", None) if is_row else P(None, None, "tensor")), layer_index)
    a_view = LayerStack(put(lora_a[None], P(None, None, None, "tensor") if is_row else P()), layer_index)
    b_views = tuple(
        LayerStack(put(b[None], P() if is_row else P(None, None, "tensor", None)), layer_index) for b in lora_bs
    )
    x = put(x, P(None, "tensor") if is_row else P())
    lora = jax.tree_util.tree_map(lambda v: put(v, P()), lora)
    backend = fused_backend(mesh)
    sharding = dict(tp_size=2, input_sharded=is_row, output_sharded=not is_row, gated=gated)
    y = jax.jit(lambda *a: backend.apply_with_base(*a, **sharding))(x, w_view, a_view, b_views, lora)
    if not is_row and not gated:  # gated: each shard's columns of the activation, in order
        y = jnp.concatenate(split_packed(y, widths, 2), axis=1)
    assert_close(y, expected)


@pytest.mark.parametrize(
    "change,why",
    [
        (dict(rank=8), "rank not a multiple of 16"),
        (dict(widths=(384,)), "part width not a multiple of 256"),
        (dict(in_dim=96), "in not a multiple of 64"),
        (dict(in_dim=40, widths=(48, 24, 24), rank=8), "odd sizes: the SGMV kernels take them"),
    ],
)
def test_modules_that_do_not_fit_the_kernel_fall_back(change, why):
    x, w, lora_a, lora_bs, lora = module_inputs(2, **change)
    assert fused_backend().apply_with_base(x, w, lora_a, lora_bs, lora, tp_size=1) is None, why


def test_float32_and_batches_without_entries_fall_back():
    x, w, lora_a, lora_bs, lora = module_inputs(3)
    backend = fused_backend()
    assert backend.apply_with_base(x.astype(jnp.float32), w, lora_a, lora_bs, lora, tp_size=1) is None
    no_entries = dataclasses.replace(lora, entries=None)
    assert backend.apply_with_base(x, w, lora_a, lora_bs, no_entries, tp_size=1) is None


def test_which_buckets_take_the_fused_gemm():
    backend = fused_backend()
    assert [backend.fused_gemm_tile_rows(t, 4) for t in (128, 256, 320, 384, 2048)] == [0, 128, 0, 128, 128]
    on_hopper = pallas_module._is_hopper(None)
    assert make_pallas_backend(None).fused_gemm_tile_rows(4096, 4) == (128 if on_hopper else 0)  # Hopper GPUs only
    assert make_pallas_backend(None).fused_gemm_tile_rows(256, 4) == 0  # default: from 512 tokens
    assert make_pallas_backend(None, fused_gemm_min_tokens=0).fused_gemm_tile_rows(4096, 4) == 0
    auto = AutoBackend(None, fused_gemm_min_tokens=256)
    pallas = auto.backends["pallas"]
    assert pallas.fused_gemm_tile_rows(2048, 2) == 128 and auto.chosen(2048, 2, 512) is pallas
    # the step's metadata carries the entry table in those buckets only, and then the layers hand over W
    for num_tokens, fused in ((2048, True), (320, False)):
        lora = build_lora_batch(np.zeros(num_tokens, np.int32), 2, np.zeros(2, np.float32), np.zeros(2, np.int32))
        meta = auto.prepare(jax.tree_util.tree_map(jnp.asarray, lora), num_seqs=4)
        assert meta.runs_base_gemm == fused and (getattr(meta, "entries", None) is not None) == fused


def test_entry_bound_holds_for_the_worst_prefill_batch():
    """entry_table sizes the table for the bucket (T / 128 + S - 1): S sequences that each cross row tile
    boundaries in the worst places fill it exactly, and no entry is dropped."""
    num_tokens, seq_lens = 512, (100, 100, 100, 212)  # every tile boundary falls inside a sequence
    token_slot = np.zeros(num_tokens, np.int32)
    token_slot[: sum(seq_lens)] = np.repeat([1, 2, 1, 2], seq_lens)
    lora = build_lora_batch(token_slot, 4, np.array([0, 1, 1], np.float32), np.array([0, 16, 16], np.int32))
    table = entry_table(jax.tree_util.tree_map(jnp.asarray, lora), 128, len(seq_lens))
    assert table.max_entries == 512 // 128 + 4 - 1
    assert int(table.entry_start[-1]) == table.max_entries


# ---- the engine ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel_sized_model(tmp_path_factory):
    """A tiny Llama whose modules fit the kernel's tiles (widths multiples of 256, in of 64), with two rank-16
    all-linear adapters written by peft."""
    return make_kernel_sized_model_and_adapters(tmp_path_factory.mktemp("fused"))


def serve_prefill(model_dir, adapters, fused_min_tokens: int, tp_size: int = 1, **flags) -> list[np.ndarray]:
    """The three PROMPTS (two adapters, one base) prefilled in one 256-token bf16 step: their prompt logprobs."""
    options = dict(lora_fused_gemm_min_tokens=fused_min_tokens, tp_size=tp_size, **flags)
    prompt, _ = serve_logprobs(model_dir, adapters, 1, **options)
    return prompt


def peft_logprobs(model_dir, adapter_dir, ids: list[int]) -> np.ndarray:
    """HF transformers (+ PEFT) prompt logprobs in float32."""
    model = load_peft_model(model_dir, adapter_dir) if adapter_dir else load_hf_model(model_dir)
    with torch.no_grad():
        tokens = torch.tensor([ids])
        return torch.log_softmax(model(tokens).logits[0], -1)[:-1].gather(1, tokens[0, 1:, None])[:, 0].numpy()


def test_engine_prefill_with_lora_in_the_gemm_matches_peft(kernel_sized_model, monkeypatch):
    """Prompt logprobs of one mixed bf16 prefill step (two adapters and the base model) with
    --lora-fused-gemm-min-tokens 256 (on a Hopper GPU, the Mosaic GPU kernel) and with 0 (the SGMV path): both
    within bf16 rounding of HF transformers + PEFT in float32 (measured on CPU: 0.08-0.10 fused, 0.12-0.13 SGMV),
    where leaving an adapter out moves them by more than 1."""
    base, adapters = kernel_sized_model
    monkeypatch.setattr(PallasGPUBackend, "GATED_MIN_TOKENS", 256)  # gate|up's activation in the 256-token step
    calls = count_calls(monkeypatch, pallas_module, "gemm_lora_gpu")
    tables, real_table = [], pallas_module.entry_table
    monkeypatch.setattr(pallas_module, "entry_table", lambda *args: tables.append(args[2:]) or real_table(*args))
    sgmv = serve_prefill(base, adapters, fused_min_tokens=0)
    assert not calls
    fused = serve_prefill(base, adapters, fused_min_tokens=256)
    assert len(calls) == 4  # q|k|v, o, gate|up and down, traced once in the layer scan
    # the model hands the backend the engine's --max-prefill-seqs, which bounds the entry table by adapter runs
    assert tables and all(max_chunks == 4 for _, max_chunks in tables)
    assert [call["gated"] for call in calls] == [False, False, True, False]  # gate|up's activation in the kernel
    for ids, adapter, ours_fused, ours_sgmv in zip(PROMPTS, adapters + [None], fused, sgmv):
        expected = peft_logprobs(base, adapter, ids)
        assert np.abs(ours_fused - expected).max() < 0.2
        assert np.abs(ours_sgmv - expected).max() < 0.2
        if adapter is not None:
            assert np.abs(peft_logprobs(base, None, ids) - expected).max() > 1.0


def test_engine_prefill_of_odd_sizes_falls_back_to_the_sgmv_kernels(tmp_path, monkeypatch):
    """A model whose projection sizes fit neither the fused GEMM's tiles nor the SGMV kernels' blocks (hidden 40,
    intermediate 88, head_dim 10: q 40, k and v 20), in a bucket that takes the fused GEMM: every module falls back
    to x @ W and the SGMV kernels, which mask past the odd sizes. Within bf16 rounding of HF + PEFT in float32,
    where leaving an adapter out moves the logprobs by more than that."""
    base = make_hf_model_dir(
        tmp_path / "base",
        "llama",
        seed=6,
        hidden_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=10,
        intermediate_size=88,
    )
    adapters = [
        write_peft_adapter(
            base, tmp_path / f"a{i}", seed=40 + i, r=16, lora_alpha=32, b_std=0.2, target_modules="all-linear"
        )
        for i in range(2)
    ]
    calls = count_calls(monkeypatch, pallas_module, "gemm_lora_gpu")
    ours = serve_prefill(base, adapters, fused_min_tokens=256, attention_backend="native")  # GPU kernels: head_dim 16+
    assert not calls
    for ids, adapter, logprobs in zip(PROMPTS, adapters + [None], ours):
        expected = peft_logprobs(base, adapter, ids)
        assert np.abs(logprobs - expected).max() < 0.2
        if adapter is not None:
            assert np.abs(peft_logprobs(base, None, ids) - expected).max() > 0.5


@NEEDS_TWO_DEVICES
def test_engine_prefill_with_lora_in_the_gemm_under_tensor_parallelism(kernel_sized_model, monkeypatch):
    """The same step at tp 2: o, gate|up and down take the fused GEMM under shard_map (down and o add their delta
    on the first shard, then all-reduce); q|k|v, 128 columns per part per shard, falls back to the SGMV path.
    Within bf16 rounding of HF transformers + PEFT in float32."""
    base, adapters = kernel_sized_model
    calls = count_calls(monkeypatch, pallas_module, "gemm_lora_gpu")
    fused = serve_prefill(base, adapters, fused_min_tokens=256, tp_size=2)
    assert len(calls) == 3
    for ids, adapter, ours in zip(PROMPTS, adapters + [None], fused):
        assert np.abs(ours - peft_logprobs(base, adapter, ids)).max() < 0.2
