"""The rotary + K/V write kernel (pallas_kernels/attention/kv_write_gpu.py) against the engine's XLA ops.

On CPU the kernel runs in Pallas interpret mode; on a CUDA GPU (marked `gpu`) compiled at the Llama-3-8B attention
shape. Every case writes layer 1 of a two-layer cache whose other rows hold random values, at shuffled slots, with
token counts that are not a multiple of the kernel's token block, so a kernel that writes another layer, another
slot, a row past the step's tokens or the wrong head fails. Padding tokens (slot 0, the scratch slot) write nothing
in the kernel, while the reference writes them in any order, so slot 0 is not compared. Given the step's real token
count (`num_rows`), the rows after it are the bucket's padding whatever they hold (NaN included) and wherever their
slots point: their q is zero and they write nothing, in the kernel and the reference alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.kv_write_gpu import (
    BLOCK_TOKENS,
    check_rope_kv_shapes,
    fits_head_dim,
    head_group,
    rope_kv_write_gpu,
    rope_kv_write_ref,
)
from sgl_jax_lora.layers.attention import write_kv
from sgl_jax_lora.layers.rotary import rotary_tables, rotate
from tests.support.cuda_target import hopper_target

ON_GPU = jax.devices()[0].platform == "gpu"
FP8_CACHES = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def make_inputs(num_tokens, heads, kv_heads, head_dim, *, dtype, cache_dtype=None, padding=0, slots=None, seed=0):
    """Random packed q|k|v, the rotary tables of positions up to 4096, a two-layer cache of random rows; the last
    `padding` tokens are padding (position 0, slot 0), the others write distinct shuffled slots."""
    rng = np.random.default_rng(seed)
    slots = slots or 2 * num_tokens + 8
    qkv = jnp.asarray(rng.standard_normal((num_tokens, (heads + 2 * kv_heads) * head_dim)), dtype)
    positions = rng.integers(0, 4097, num_tokens)
    cache_loc = rng.permutation(np.arange(1, slots))[:num_tokens]
    positions[num_tokens - padding :], cache_loc[num_tokens - padding :] = 0, 0
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    cos, sin = rotary_tables(jnp.asarray(positions, jnp.int32), inv_freq)
    shape = (2, kv_heads, slots, head_dim)
    k_cache = jnp.asarray(rng.standard_normal(shape), cache_dtype or dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), cache_dtype or dtype)
    return qkv, cos, sin, jnp.asarray(cache_loc, jnp.int32), k_cache, v_cache


def run_both(inputs, heads, kv_heads, *, interpret):
    qkv, cos, sin, cache_loc, k_cache, v_cache = inputs
    args = (qkv, cos, sin, cache_loc, jnp.int32(1))
    counts = dict(num_heads=heads, num_kv_heads=kv_heads)
    want = rope_kv_write_ref(*args, k_cache, v_cache, **counts)
    got = rope_kv_write_gpu(*args, jnp.copy(k_cache), jnp.copy(v_cache), **counts, interpret=interpret)
    return [np.asarray(a.astype(jnp.float32)) for a in want], [np.asarray(a.astype(jnp.float32)) for a in got]


def assert_written_as(want, got, tolerance):
    q_want, k_want, v_want = want
    q_got, k_got, v_got = got
    np.testing.assert_allclose(q_got, q_want, atol=tolerance, rtol=tolerance)
    for cache_got, cache_want in ((k_got, k_want), (v_got, v_want)):  # slot 0: the padding's scratch, any order
        np.testing.assert_allclose(cache_got[:, :, 1:], cache_want[:, :, 1:], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("num_tokens", [1, BLOCK_TOKENS, 2 * BLOCK_TOKENS + 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (8, 2, 64), (4, 1, 128), (32, 8, 32), (12, 6, 32)])
def test_interpret_f32_matches_reference(num_tokens, heads, kv_heads, head_dim):
    inputs = make_inputs(num_tokens, heads, kv_heads, head_dim, dtype=jnp.float32, padding=num_tokens // 4)
    assert_written_as(*run_both(inputs, heads, kv_heads, interpret=True), tolerance=1e-5)


def test_untouched_rows_keep_their_values():
    # every slot the step does not name (the padding's slot 0 included), and all of layer 0, hold what they held
    qkv, cos, sin, cache_loc, k_cache, v_cache = make_inputs(37, 4, 2, 32, dtype=jnp.float32, padding=5)
    _, k_new, v_new = rope_kv_write_gpu(
        qkv, cos, sin, cache_loc, jnp.int32(1), jnp.copy(k_cache), jnp.copy(v_cache), num_heads=4,
        num_kv_heads=2, interpret=True,
    )  # fmt: skip
    untouched = np.setdiff1d(np.arange(k_cache.shape[2]), np.asarray(cache_loc)[:-5])
    assert 0 in untouched
    for before, after in ((k_cache, k_new), (v_cache, v_new)):
        np.testing.assert_array_equal(np.asarray(after[0]), np.asarray(before[0]))
        np.testing.assert_array_equal(np.asarray(after[1][:, untouched]), np.asarray(before[1][:, untouched]))
        assert not np.array_equal(np.asarray(after[1]), np.asarray(before[1]))


def test_bf16_equals_the_engines_xla_ops():
    # what a decoder layer computes without the kernel: rotate q and k, then write_kv
    heads, kv_heads, head_dim = 8, 2, 64
    qkv, cos, sin, cache_loc, k_cache, v_cache = make_inputs(
        70, heads, kv_heads, head_dim, dtype=jnp.bfloat16, padding=6
    )
    split = np.cumsum([heads * head_dim, kv_heads * head_dim])
    q, k, v = (p.reshape(70, -1, head_dim) for p in jnp.split(qkv, split, axis=1))
    k_xla, v_xla = write_kv(k_cache, v_cache, jnp.int32(1), rotate(k, cos, sin), v, cache_loc)
    want = [np.asarray(a.astype(jnp.float32)) for a in (rotate(q, cos, sin), k_xla, v_xla)]
    got = rope_kv_write_gpu(
        qkv, cos, sin, cache_loc, jnp.int32(1), jnp.copy(k_cache), jnp.copy(v_cache), num_heads=heads,
        num_kv_heads=kv_heads, interpret=True,
    )  # fmt: skip
    # one bf16 step at most: the products and differences may round differently (fused multiply-adds)
    assert_written_as(want, [np.asarray(a.astype(jnp.float32)) for a in got], tolerance=8e-3)


@pytest.mark.parametrize("cache_dtype", FP8_CACHES)
def test_fp8_cache_saturates_as_write_kv(cache_dtype):
    """Bit for bit on the CPU: on a GPU machine XLA's reference contracts the rotation's products into fused
    multiply-adds, which can land one 8-bit step away from the interpreted kernel's."""
    heads, kv_heads, head_dim = 4, 2, 32
    with jax.default_device(jax.devices("cpu")[0]):
        inputs = list(make_inputs(40, heads, kv_heads, head_dim, dtype=jnp.bfloat16, cache_dtype=cache_dtype))
        inputs[0] = inputs[0].at[:, -head_dim:].set(1e6).at[:, heads * head_dim].set(-1e6)  # last v head, a k column
        want, got = run_both(inputs, heads, kv_heads, interpret=True)
    assert np.isfinite(got[1]).all() and np.isfinite(got[2]).all()
    limit = float(jnp.finfo(cache_dtype).max)
    assert (got[2][1, kv_heads - 1, np.asarray(inputs[3])] == limit).all()
    assert_written_as(want, got, tolerance=0)


def padded_step(num_tokens, num_real, heads, kv_heads, head_dim, dtype):
    """A bucket of `num_tokens` rows whose first `num_real` are real: (inputs as the engine has them, the padding
    rows of q|k|v zero and their slots 0; the same with garbage in the padding rows (NaN, inf, huge values) and
    their slots pointing at slots no real token writes, one at a real token's slot; [1] i32 num_rows)."""
    qkv, cos, sin, cache_loc, k_cache, v_cache = make_inputs(
        num_tokens, heads, kv_heads, head_dim, dtype=dtype, padding=num_tokens - num_real, seed=num_real
    )
    is_real = (np.arange(num_tokens) < num_real)[:, None]
    zeroed = jnp.where(is_real, qkv, 0)
    rng = np.random.default_rng(num_tokens)
    garbage = rng.choice([np.nan, np.inf, -np.inf, 1e30, 3.0], size=qkv.shape)
    dirty = jnp.where(is_real, qkv, jnp.asarray(garbage, dtype))
    unused = np.setdiff1d(np.arange(1, k_cache.shape[2]), np.asarray(cache_loc)[:num_real])
    dirty_loc = np.asarray(cache_loc).copy()
    dirty_loc[num_real:] = unused[: num_tokens - num_real]
    if 0 < num_real < num_tokens:
        dirty_loc[-1] = dirty_loc[0]  # a padding row naming a real token's slot
    rows = jnp.array([num_real], jnp.int32)
    engine = (zeroed, cos, sin, cache_loc, k_cache, v_cache)
    return engine, (dirty, cos, sin, jnp.asarray(dirty_loc, jnp.int32), k_cache, v_cache), rows


def run_kernel(inputs, heads, kv_heads, num_rows=None, interpret=True):
    qkv, cos, sin, cache_loc, k_cache, v_cache = inputs
    out = rope_kv_write_gpu(
        qkv, cos, sin, cache_loc, jnp.int32(1), jnp.copy(k_cache), jnp.copy(v_cache), num_heads=heads,
        num_kv_heads=kv_heads, num_rows=num_rows, interpret=interpret,
    )  # fmt: skip
    return [np.asarray(a.astype(jnp.float32)) for a in out]


def run_ref(inputs, heads, kv_heads, num_rows=None):
    qkv, cos, sin, cache_loc, k_cache, v_cache = inputs
    out = rope_kv_write_ref(
        qkv, cos, sin, cache_loc, jnp.int32(1), k_cache, v_cache, num_heads=heads, num_kv_heads=kv_heads,
        num_rows=num_rows,
    )  # fmt: skip
    return [np.asarray(a.astype(jnp.float32)) for a in out]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_real", [0, 1, BLOCK_TOKENS, 13, 2 * BLOCK_TOKENS + 5])
def test_rows_from_num_rows_on_read_as_zeros_and_write_nothing(dtype, num_real):
    """The bucket's padding rows hold garbage (the q|k|v GEMM left them unwritten) and name real slots: the kernel
    given num_rows gives, bit for bit, what it gives the engine's padded step today (padding rows zero, slot 0), and
    the reference does too: q zero in the padding rows, and no padding row's k or v in the cache."""
    heads, kv_heads, head_dim, num_tokens = 4, 2, 32, 2 * BLOCK_TOKENS + 5
    engine, dirty, rows = padded_step(num_tokens, num_real, heads, kv_heads, head_dim, dtype)
    today = run_kernel(engine, heads, kv_heads)  # the zeroed rows, without num_rows
    got = run_kernel(dirty, heads, kv_heads, rows)
    assert not np.isnan(got[0]).any() and not got[0][num_real:].any()
    for before, after, name in zip(today, got, "qkv"):
        np.testing.assert_array_equal(after, before, err_msg=name)
    assert np.array_equal(run_kernel(engine, heads, kv_heads, rows)[0], today[0])  # zero padding: as today
    # nothing written at the slots the padding rows name (k and v caches hold what they held there)
    padding_slots = np.setdiff1d(np.asarray(dirty[3])[num_real:], np.asarray(engine[3])[:num_real])
    for cache, before in zip(got[1:], engine[4:]):
        np.testing.assert_array_equal(cache[1][:, padding_slots], np.asarray(before[1][:, padding_slots], np.float32))
    # the reference: as if the step held its real rows only, and the kernel within rounding of it
    want = run_ref(dirty, heads, kv_heads, rows)
    only_real = run_ref(tuple(a[:num_real] for a in engine[:4]) + engine[4:], heads, kv_heads)
    np.testing.assert_array_equal(want[0][:num_real], only_real[0])
    assert not want[0][num_real:].any()
    np.testing.assert_array_equal(want[1], only_real[1])
    np.testing.assert_array_equal(want[2], only_real[2])
    tolerance = 1e-5 if dtype == jnp.float32 else 8e-3
    for got_part, want_part in zip(got, want):  # every slot, the scratch slot 0 included: no row writes it
        np.testing.assert_allclose(got_part, want_part, atol=tolerance, rtol=tolerance)
    if num_real < num_tokens:  # the garbage would show: the reference without num_rows writes it
        unmasked = run_ref(dirty, heads, kv_heads)
        assert not np.array_equal(np.nan_to_num(unmasked[2]), np.nan_to_num(want[2]))


def test_a_head_group_never_spans_two_of_q_k_v():
    assert head_group(32, 8) == 8 and head_group(8, 2) == 2 and head_group(12, 6) == 2 and head_group(4, 1) == 1
    assert head_group(64, 64) == 8  # at most MAX_HEAD_GROUP


@pytest.mark.parametrize("head_dim", [80, 8, 96])
def test_unsupported_head_dims_name_the_way_out(head_dim):
    assert not fits_head_dim(head_dim)
    with pytest.raises(ValueError, match="with XLA ops for such heads"):
        check_rope_kv_shapes(4, 2, head_dim, 8 * head_dim)
    assert fits_head_dim(128) and fits_head_dim(64) and fits_head_dim(32)


def test_mismatched_packed_width_is_refused():
    with pytest.raises(ValueError, match="not \\(4 \\+ 2 x 2\\) heads x 64"):
        check_rope_kv_shapes(4, 2, 64, 7 * 64)


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_lowers_for_cuda_with_the_caches_aliased(cache_dtype):
    # Triton lowering needs no GPU: the kernel at the Llama-3-8B attention shape, the caches its outputs in place
    shape = jax.ShapeDtypeStruct
    cache = shape((32, 8, 4096, 128), cache_dtype)
    i32 = functools.partial(shape, dtype=jnp.int32)
    table = shape((512, 64), jnp.float32)
    args = (shape((512, 48 * 128), jnp.bfloat16), table, table, i32((512,)), i32(()))
    run = functools.partial(rope_kv_write_gpu, num_heads=32, num_kv_heads=8)
    with hopper_target():
        lowered = jax.jit(run, donate_argnums=(5, 6)).trace(*args, cache, cache).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "rope_kv_write" in text
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", [None, *FP8_CACHES])
@pytest.mark.parametrize("num_tokens", [64, 1000])
def test_kernel_on_gpu_bf16(cache_dtype, num_tokens):
    inputs = make_inputs(
        num_tokens, 32, 8, 128, dtype=jnp.bfloat16, cache_dtype=cache_dtype, padding=num_tokens // 10, seed=1
    )
    assert_written_as(*run_both(inputs, 32, 8, interpret=False), tolerance=8e-3 if cache_dtype is None else 0.07)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_real", [0, 345, 1000])
def test_kernel_on_gpu_masks_the_rows_from_num_rows_on(num_real):
    """Compiled at the Llama-3-8B attention shape, garbage in the padding rows of q|k|v and real slots named by
    them: bit for bit what the kernel gives the engine's padded step without num_rows (zero rows, slot 0)."""
    heads, kv_heads = 32, 8
    engine, dirty, rows = padded_step(1000, num_real, heads, kv_heads, 128, jnp.bfloat16)
    today = run_kernel(engine, heads, kv_heads, interpret=False)
    got = run_kernel(dirty, heads, kv_heads, rows, interpret=False)
    assert not got[0][num_real:].any()
    for before, after, name in zip(today, got, "qkv"):
        np.testing.assert_array_equal(after, before, err_msg=name)
