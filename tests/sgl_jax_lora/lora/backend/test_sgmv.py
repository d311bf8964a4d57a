"""sgl_jax_lora/lora/backend/sgmv.py: SgmvBackend, in both formulations ("ragged": tokens permuted into segments and
one ragged_dot; "segment_onehot": x against each segment's weights, each token keeping its own segment's row), matches
a numpy loop over the tokens (y_t += scale[slot_t] * (x_t @ A[slot_t].T) @ B[slot_t].T) in float32 and bfloat16;
tokens of no adapter keep the base output bit for bit; a NaN or Inf slot changes no other slot's tokens; a segment
bucket larger than the segments present (empty padding segments of slot 0) gives the same result; `token_segment`
maps each token to its segment; the platform picks the method."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.lora.backend.sgmv import METHODS, SgmvBackend, token_segment
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from tests.support.lora_backends import (
    SLOT_RANKS,
    SLOT_SCALE,
    apply,
    assert_close,
    check_apply_matches_the_per_token_reference,
    check_shrink_and_expand,
    check_tokens_of_no_adapter_keep_the_base_output,
    per_token_reference,
    slot_inputs,
)


@functools.cache
def jitted_apply(method: str):
    """The whole LoRA of one module (`prepare`, `apply_packed`), jitted as the engine runs it; one per method, so
    that tests of equal shapes share its compiled programs."""
    backend = SgmvBackend(None, method=method)
    return jax.jit(lambda x, a, b, lora, base: apply(backend, x, a, b, lora, base_out=base))


def run(method: str, x, lora_a, lora_b, lora, base=None, dtype=jnp.float32):
    base = np.zeros((x.shape[0], lora_b.shape[1]), np.float32) if base is None else base
    operands = (jnp.asarray(t, dtype) for t in (x, lora_a, lora_b))
    return jitted_apply(method)(*operands, lora, jnp.asarray(base, dtype))


@pytest.mark.parametrize("method", METHODS)
def test_shrink_and_expand_pick_each_tokens_own_slot(method):
    check_shrink_and_expand(SgmvBackend(None, method=method))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
def test_apply_matches_the_per_token_reference(method, dtype):
    check_apply_matches_the_per_token_reference(functools.partial(run, method), dtype)


@pytest.mark.parametrize("method", METHODS)
def test_tokens_of_no_adapter_keep_the_base_output_exactly(method):
    check_tokens_of_no_adapter_keep_the_base_output(functools.partial(run, method))


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_slot_reaches_only_its_own_tokens(method, poison):
    x, lora_a, lora_b, lora = slot_inputs(seed=5)
    clean = np.asarray(run(method, x, lora_a, lora_b, lora))
    lora_a[3, 0, :5] = poison  # slot 3: rank 2, so row 0 and column 0 are live
    lora_b[3, :5, 0] = poison
    out = np.asarray(run(method, x, lora_a, lora_b, lora))
    slots = np.asarray(lora.token_slot)
    others = slots != 3
    np.testing.assert_array_equal(out[others], clean[others])
    assert not np.array_equal(out[~others], clean[~others])  # its own tokens do see the change


@pytest.mark.parametrize("method", METHODS)
def test_segment_buckets_larger_than_the_segments_present(method):
    # 3 distinct slots (0, 1, 3): G = 3 has no padding, G = 16 adds 13 empty segments (start = end = T, slot 0)
    rng = np.random.default_rng(6)
    x, lora_a, lora_b, _ = slot_inputs(seed=6)
    token_slot = rng.choice([0, 1, 3], 24).astype(np.int32)
    token_slot[:3] = (0, 1, 3)
    expected = per_token_reference(x, lora_a, lora_b, token_slot, SLOT_SCALE)
    outs = {}
    for num_segments in (3, 16):
        lora = build_lora_batch(token_slot, num_segments, SLOT_SCALE, np.array(SLOT_RANKS))
        assert (lora.seg_start[3:] == 24).all() and (lora.seg_slot[3:] == 0).all()
        outs[num_segments] = np.asarray(run(method, x, lora_a, lora_b, jax.tree_util.tree_map(jnp.asarray, lora)))
        assert_close(outs[num_segments], expected, jnp.float32)
    # the padding changes the compiled program (summation order), not the result
    np.testing.assert_allclose(outs[16], outs[3], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_more_segments_than_tokens(method):
    # 3 tokens, 2 slots, a bucket of 8 segments: 6 of them empty
    x, lora_a, lora_b, _ = slot_inputs(seed=7)
    token_slot = np.array([2, 0, 2], np.int32)
    lora = build_lora_batch(token_slot, 8, SLOT_SCALE, np.array(SLOT_RANKS))
    out = run(method, x[:3], lora_a, lora_b, jax.tree_util.tree_map(jnp.asarray, lora))
    assert_close(out, per_token_reference(x[:3], lora_a, lora_b, token_slot, SLOT_SCALE), jnp.float32)
    assert (np.asarray(out)[1] == 0).all()


def test_token_segment_is_the_rank_of_each_tokens_slot_among_those_present():
    token_slot = np.array([5, 0, 2, 5, 2, 2, 0, 7], np.int32)
    for num_segments in (4, 9):
        lora = build_lora_batch(token_slot, num_segments, np.ones(8, np.float32), np.ones(8))
        seg = np.asarray(jax.jit(token_segment)(jax.tree_util.tree_map(jnp.asarray, lora)))
        # slots present, sorted: 0, 2, 5, 7 -> segments 0, 1, 2, 3
        np.testing.assert_array_equal(seg, [2, 0, 1, 2, 1, 1, 0, 3])
        assert seg.dtype == np.int32


def fake_mesh(platform: str):
    return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)]), size=1)


def test_the_platform_picks_the_method_and_unknown_methods_are_refused():
    assert SgmvBackend(None).method == ("segment_onehot" if jax.default_backend() == "gpu" else "ragged")
    for platform, method in [("gpu", "segment_onehot"), ("cuda", "segment_onehot"), ("rocm", "segment_onehot")]:
        assert SgmvBackend(fake_mesh(platform)).method == method
    for platform in ("tpu", "cpu"):
        assert SgmvBackend(fake_mesh(platform)).method == "ragged"
    assert SgmvBackend(fake_mesh("gpu"), method="ragged").method == "ragged"  # an explicit method wins
    with pytest.raises(ValueError, match="sgmv method 'dense'"):
        SgmvBackend(None, method="dense")
    assert SgmvBackend(None).name == "sgmv"
