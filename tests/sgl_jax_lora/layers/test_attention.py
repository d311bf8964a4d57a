"""Paged attention against a direct per-token reference, on the ragged batches the scheduler really builds.

Each backend that runs on CPU (native; the pure-JAX reference of pallas_kernels/attention) is checked. The native
path lays the queries out in rows of tokens of one sequence (layers/attention.py, native_query_layout); these cases
put sequences across row boundaries, after a cached prefix, beside one-token chunks and decode rows, so a token that
lands in the wrong row or reads another sequence's keys changes the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import ragged_paged_attention_ref
from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.layers.attention import (
    QUERY_TILE,
    AttentionBackend,
    fuses_rope_kv_write,
    native_query_layout,
    paged_attention,
    plan_attention,
    rotate_and_write_kv,
    write_kv,
)
from sgl_jax_lora.layers.linear import pack_parts
from sgl_jax_lora.layers.rotary import apply_rotary, rotary_tables
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.sampling.sampling_params import SamplingParams

PAGE, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
NUM_PAGES = 400


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    """f32 products at full precision on every platform (GPUs default to TF32), so 1e-5 holds."""
    with jax.default_matmul_precision("highest"):
        yield


def make_reqs(spans: list[tuple[int, int]], rng: np.random.Generator) -> list[Req]:
    """One request per (cached prefix, new tokens), holding shuffled pages for prefix + new."""
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    reqs = []
    for i, (prefix, new) in enumerate(spans):
        ids = list(range(2, 2 + prefix + new))
        req = Req(rid=f"r{i}", input_ids=ids, sampling=SamplingParams(max_new_tokens=1), seed=0)
        req.num_computed = prefix
        req.pages = [int(free.pop()) for _ in range(-(-(prefix + new) // PAGE))]
        reqs.append(req)
    return reqs


def run_attention(
    fb,
    rng: np.random.Generator,
    backend: str | AttentionBackend = "native",
    cache_dtype=jnp.float32,
    head_dim: int = DIM,
    plan=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random q and caches (stored in cache_dtype) for this batch -> (q, k_cache, v_cache as float32 of the stored
    values, the backend's output). backend: "reference" (the pure-JAX kernel reference) or an attention backend, its
    name or itself (with its mesh); plan: `plan_attention`'s, handed to `paged_attention`."""
    stored = lambda c: np.asarray(jnp.asarray(c).astype(cache_dtype).astype(jnp.float32))  # noqa: E731
    k_cache = stored(rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, head_dim)).astype(np.float32))
    v_cache = stored(rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, head_dim)).astype(np.float32))
    q = rng.standard_normal((fb.num_tokens, HEADS, head_dim)).astype(np.float32)
    # the caches of every layer go in whole; layer 1 is read, layer 0 holds other values
    k_stack, v_stack = (jnp.asarray(np.stack([-c, c])).astype(cache_dtype) for c in (k_cache, v_cache))
    args = (jnp.asarray(q), k_stack, v_stack, jnp.int32(1), fb.seq_lens, fb.page_table, fb.cu_q_lens)
    if backend == "reference":
        got = ragged_paged_attention_ref(*args, page_size=PAGE, scale=head_dim**-0.5)
    else:
        backend = backend if isinstance(backend, AttentionBackend) else AttentionBackend(backend)
        got = paged_attention(*args, PAGE, head_dim**-0.5, backend, plan=plan)
    return q, k_cache, v_cache, np.asarray(got)


def reference(q, k_cache, v_cache, reqs, new_tokens) -> np.ndarray:
    """Each new token attends to its own sequence's keys at positions <= its own, read slot by slot."""
    out, row = np.zeros_like(q), 0
    group = HEADS // KV_HEADS
    for req, n in zip(reqs, new_tokens):
        for pos in range(req.num_computed, req.num_computed + n):
            slots = [req.pages[p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
            for h in range(HEADS):
                keys, values = k_cache[h // group, slots], v_cache[h // group, slots]
                scores = keys @ q[row, h] / np.sqrt(q.shape[-1])
                probs = np.exp(scores - scores.max())
                out[row, h] = probs / probs.sum() @ values
            row += 1
    return out[:row]


def schedule_batch(spans: list[tuple[int, int]], rng: np.random.Generator, num_decode_rows: int = 0):
    """A ScheduleBatch of one request per (cached prefix, new tokens); the first num_decode_rows requests are decode
    rows (their last token is a sampled one)."""
    reqs = make_reqs(spans, rng)
    for req in reqs[:num_decode_rows]:
        req.output_ids = [req.input_ids.pop()]
    return ScheduleBatch(
        reqs=reqs, num_new_tokens=[n for _, n in spans], token_slots=[0] * len(reqs), num_decode_rows=num_decode_rows
    )


SPANS = [
    ([(0, 5), (3, 130), (0, QUERY_TILE), (200, 1)], 0),  # crosses a row boundary, fills one row exactly
    ([(0, 300)], 0),  # one sequence: a single row
    ([(0, 300), (10, 100)], 0),  # two sequences: rows of 256, the first over two
    ([(17, 1), (0, 1), (5, 2)], 0),  # tokens fewer than a tile
    ([(9, 1), (1, 1), (130, 1)], 3),  # decode rows only
    ([(9, 1), (63, 1), (130, 1), (0, 37), (4, 200)], 3),  # decode rows and prefill chunks in one step
]


@pytest.mark.parametrize("backend", ["native", "reference", "pallas_interpret"])
@pytest.mark.parametrize("spans,num_decode_rows", SPANS)
def test_ragged_step_matches_reference(spans, num_decode_rows, backend):
    rng = np.random.default_rng(len(spans))
    batch = schedule_batch([(p - (i < num_decode_rows), n) for i, (p, n) in enumerate(spans)], rng, num_decode_rows)
    buckets = Buckets.build(8, 512, 1024, PAGE)
    fb = batch.to_forward_batch(buckets, PAGE, lambda slots: None)
    q, k_cache, v_cache, got = run_attention(fb, rng, backend)

    real = batch.num_tokens
    np.testing.assert_allclose(
        got[:real], reference(q, k_cache, v_cache, batch.reqs, batch.num_new_tokens), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(got[real:], 0)  # padding tokens


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("spans,num_decode_rows", [SPANS[4], SPANS[5]], ids=["decode-rows-alone", "mixed"])
def test_the_gpu_kernels_take_the_steps_plan_under_tensor_parallelism(monkeypatch, spans, num_decode_rows, tp_size):
    """The pallas_gpu path as the model runs it, its kernels in interpret mode: `plan_attention` builds the step's
    plan once from the ForwardBatch (a decode-only plan for a step of decode rows alone in buckets with decode
    programs, which leaves the general kernel out; the any-mix plan otherwise) and `paged_attention` hands it to the
    kernels, under tp 2 inside shard_map with the plan replicated and each device on its own heads (a head of 16,
    the kernels' smallest). The real tokens match the per-token reference, the padding's are zero."""
    import pallas_kernels.attention.gpu as attention_gpu

    kernel = attention_gpu.ragged_paged_attention_gpu
    monkeypatch.setattr(attention_gpu, "ragged_paged_attention_gpu", functools.partial(kernel, interpret=True))
    rng = np.random.default_rng(3 + len(spans))
    batch = schedule_batch([(p - (i < num_decode_rows), n) for i, (p, n) in enumerate(spans)], rng, num_decode_rows)
    buckets = Buckets.build(8, 512, 1024, PAGE, decode_programs=True)
    fb = batch.to_forward_batch(buckets, PAGE, lambda slots: None)
    assert fb.decode_only == (num_decode_rows == len(spans))
    backend = AttentionBackend("pallas_gpu", make_mesh(tp_size))
    plan = plan_attention(
        backend, fb.seq_lens, fb.page_table, fb.cu_q_lens, fb.num_tokens, HEADS // KV_HEADS, jnp.float32, fb.decode_only
    )
    assert plan.decode_only == fb.decode_only
    q, k_cache, v_cache, got = run_attention(fb, rng, backend, head_dim=16, plan=plan)
    real = batch.num_tokens
    want = reference(q, k_cache, v_cache, batch.reqs, batch.num_new_tokens)
    np.testing.assert_allclose(got[:real], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[real:], 0)


@pytest.mark.parametrize("backend", ["native", "reference", "pallas_interpret"])
@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_caches_are_read_as_the_values_they_hold(cache_dtype, backend):
    # --kv-cache-dtype fp8_*: every backend widens the 8-bit K/V to q's dtype, so a mixed step matches the
    # per-token reference over the stored values to float32 rounding
    spans, num_decode_rows = SPANS[-1]
    rng = np.random.default_rng(11)
    batch = schedule_batch([(p - (i < num_decode_rows), n) for i, (p, n) in enumerate(spans)], rng, num_decode_rows)
    fb = batch.to_forward_batch(Buckets.build(8, 512, 1024, PAGE), PAGE, lambda slots: None)
    q, k_cache, v_cache, got = run_attention(fb, rng, backend, cache_dtype)
    want = reference(q, k_cache, v_cache, batch.reqs, batch.num_new_tokens)
    np.testing.assert_allclose(got[: batch.num_tokens], want, rtol=1e-5, atol=1e-5)


def test_native_layout_rows_hold_any_split():
    """R rows of Q hold every split of T tokens over S sequences: the worst case is S - 1 one-token sequences and one
    long one, each starting a row."""
    for num_seqs, num_tokens in [(8, 8), (8, 64), (64, 128), (8, 2048), (64, 2048), (1, 300)]:
        rows, tile = native_query_layout(num_seqs, num_tokens)
        worst = (num_seqs - 1) + -(-(num_tokens - num_seqs + 1) // tile)
        assert rows >= worst and rows * tile >= num_tokens


@pytest.mark.parametrize("backend", ["native", "reference", "pallas_interpret"])
def test_stale_non_finite_kv_is_never_read(backend):
    """Pages freed by a request whose adapter produced NaN keep their K/V; a sequence whose page holds such slots
    past its length (or a padding row reading page 0) still gets finite, unchanged outputs."""
    rng = np.random.default_rng(7)
    batch = schedule_batch([(9, 1), (0, 6)], rng, num_decode_rows=1)
    fb = batch.to_forward_batch(Buckets.build(8, 512, 1024, PAGE), PAGE, lambda slots: None)
    q = jnp.asarray(rng.standard_normal((fb.num_tokens, HEADS, DIM)), jnp.float32)
    caches = [rng.standard_normal((2, KV_HEADS, NUM_PAGES * PAGE, DIM)).astype(np.float32) for _ in range(2)]
    poisoned = [c.copy() for c in caches]
    for c in poisoned:  # every slot no sequence of the step may read: the rest of each last page, and page 0
        c[:, :, :PAGE] = np.nan
        for req in batch.reqs:
            last = req.pages[-1] * PAGE
            c[:, :, last + (req.seq_len - 1) % PAGE + 1 : last + PAGE] = np.nan

    def run(k, v):
        k, v = jnp.asarray(k), jnp.asarray(v)
        if backend == "reference":
            return np.asarray(
                ragged_paged_attention_ref(
                    q, k, v, jnp.int32(1), fb.seq_lens, fb.page_table, fb.cu_q_lens, page_size=PAGE, scale=DIM**-0.5
                )
            )
        layout = (fb.seq_lens, fb.page_table, fb.cu_q_lens)
        return np.asarray(paged_attention(q, k, v, jnp.int32(1), *layout, PAGE, DIM**-0.5, AttentionBackend(backend)))

    clean, got = run(*caches), run(*poisoned)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, clean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_write_kv_writes_exactly_the_step_rows(dtype):
    # every value of the caches but the written slots of the written layer is unchanged, bit for bit (16- and 8-bit
    # float caches are scattered as raw bits on CPU); the written rows hold k and v in the cache dtype
    rng = np.random.default_rng(0)
    layers, slots = 3, 64
    k_cache = jnp.asarray(rng.normal(size=(layers, KV_HEADS, slots, DIM)), dtype)
    v_cache = jnp.asarray(rng.normal(size=(layers, KV_HEADS, slots, DIM)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(5, KV_HEADS, DIM)), jnp.float32) for _ in range(2))
    loc = jnp.asarray([7, 0, 63, 12, 8], jnp.int32)
    expected = [np.array(c).copy() for c in (k_cache, v_cache)]
    for cache, rows in zip(expected, (k, v)):
        cache[1][:, np.asarray(loc)] = np.asarray(rows.astype(dtype)).transpose(1, 0, 2)
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    got = step(k_cache, v_cache, jnp.int32(1), k, v, loc)
    for ours, theirs in zip(got, expected):
        assert ours.dtype == dtype
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint8), theirs.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_write_kv_saturates_an_fp8_cache(dtype):
    # float8_e4m3fn has no inf: a plain cast of 500 gives NaN, which would poison every later read of the slot
    limit = float(jnp.finfo(dtype).max)
    cache = jnp.zeros((1, 1, 4, 2), dtype)
    rows = jnp.asarray([[[3 * limit, -3 * limit]], [[1.5, -0.25]]], jnp.float32)  # [2 tokens, 1 head, 2]
    k, _ = jax.jit(write_kv)(cache, cache, jnp.int32(0), rows, rows, jnp.asarray([1, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(k[0, 0, 1:3].astype(jnp.float32)), [[limit, -limit], [1.5, -0.25]])


def test_only_programs_lowered_for_cpu_write_kv_as_raw_bits():
    # GPU and TPU scatter bfloat16 as it is: their lowerings (exported from this CPU host) hold no bitcast
    cache = jax.ShapeDtypeStruct((2, KV_HEADS, 64, DIM), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((4, KV_HEADS, DIM), jnp.float32)
    args = (cache, cache, jax.ShapeDtypeStruct((), jnp.int32), rows, rows, jax.ShapeDtypeStruct((4,), jnp.int32))
    for platform, as_bits in (("cpu", True), ("cuda", False), ("tpu", False)):
        module = jax.export.export(jax.jit(write_kv), platforms=[platform])(*args).mlir_module()
        assert ("bitcast_convert" in module) == as_bits, platform


def test_only_the_gpu_backend_fuses_rotary_and_kv_write():
    assert fuses_rope_kv_write(AttentionBackend("pallas_gpu"), 128)
    assert not fuses_rope_kv_write(AttentionBackend("pallas_gpu"), 80)  # a head the kernel does not take: XLA ops
    for name in ("native", "pallas_tpu", "pallas_interpret"):
        assert not fuses_rope_kv_write(AttentionBackend(name), 128)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_rotate_and_write_kv_equals_rotary_then_write_kv(tp_size):
    # the kernel (interpret mode) on each tensor shard's packed q|k|v columns gives what a layer computes without
    # it: q and k rotated by apply_rotary, k and v written by write_kv
    heads, kv_heads, head_dim, tokens, inv_freq = 4, 2, 32, 21, tuple(1.0 / 100.0 ** (np.arange(16) / 16))
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(tokens, n, head_dim)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    positions = jnp.asarray(rng.integers(0, 900, tokens), jnp.int32)
    loc = jnp.asarray(rng.permutation(np.arange(1, 64))[:tokens], jnp.int32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(2, kv_heads, 64, head_dim)), jnp.float32) for _ in range(2))
    want_k, want_v = write_kv(k_cache, v_cache, jnp.int32(1), apply_rotary(k, positions, inv_freq), v, loc)
    mesh = make_mesh(tp_size)
    qkv = pack_parts([x.reshape(tokens, -1) for x in (q, k, v)], tp_size)
    shard = lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec))  # noqa: E731
    backend = AttentionBackend("pallas_gpu", mesh)
    caches = (shard(c, jax.P(None, "tensor", None, None)) for c in (k_cache, v_cache))
    rotary = rotary_tables(positions, inv_freq)
    args = (shard(qkv, jax.P(None, "tensor")), *caches, jnp.int32(1), rotary, loc, heads, backend)
    got_q, got_k, got_v = jax.jit(rotate_and_write_kv, static_argnums=(6, 7, 8))(*args, True)
    np.testing.assert_allclose(np.asarray(got_q), np.asarray(apply_rotary(q, positions, inv_freq)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_rotate_and_write_kv_masks_the_rows_from_num_rows_on(tp_size):
    # the step's last 5 tokens are the bucket's padding, their q|k|v rows NaN (a GEMM that left them unwritten) and
    # their slots real ones: on every tensor shard q is zero there and the caches get the real tokens' k and v only
    heads, kv_heads, head_dim, tokens, real, inv_freq = 4, 2, 32, 21, 16, tuple(1.0 / 100.0 ** (np.arange(16) / 16))
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(tokens, n, head_dim)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    positions = jnp.asarray(rng.integers(0, 900, tokens), jnp.int32)
    loc = jnp.asarray(rng.permutation(np.arange(1, 64))[:tokens], jnp.int32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(2, kv_heads, 64, head_dim)), jnp.float32) for _ in range(2))
    rotated_k = apply_rotary(k, positions, inv_freq)[:real]
    want_k, want_v = write_kv(k_cache, v_cache, jnp.int32(1), rotated_k, v[:real], loc[:real])
    mesh = make_mesh(tp_size)
    qkv = pack_parts([x.reshape(tokens, -1) for x in (q, k, v)], tp_size).at[real:].set(jnp.nan)
    shard = lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec))  # noqa: E731
    caches = (shard(c, jax.P(None, "tensor", None, None)) for c in (k_cache, v_cache))
    rotary = rotary_tables(positions, inv_freq)
    args = (shard(qkv, jax.P(None, "tensor")), *caches, jnp.int32(1), rotary, loc, heads)
    run = jax.jit(rotate_and_write_kv, static_argnums=(6, 7, 8))
    got_q, got_k, got_v = run(*args, AttentionBackend("pallas_gpu", mesh), True, jnp.array([real], jnp.int32))
    np.testing.assert_allclose(
        np.asarray(got_q[:real]), np.asarray(apply_rotary(q, positions, inv_freq)[:real]), atol=1e-5
    )
    assert not np.asarray(got_q[real:]).any()
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
