"""sgl_jax_lora/lora/backend/bgmv.py: BgmvBackend's shrink, expand and whole per-token LoRA match a numpy loop over
the tokens (y_t += scale[slot_t] * (x_t @ A[slot_t].T) @ B[slot_t].T) in float32 and bfloat16; tokens of no adapter
(slot 0) keep the base output bit for bit, and a NaN adapter reaches its own tokens only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from tests.support.lora_backends import apply, per_token_reference, random_slots

SLOT_RANKS = (0, 4, 8, 2)  # slot 0: the base model
SLOT_SCALE = np.array([0.0, 2.0, 0.5, 1.5], np.float32)
# f32: HIGHEST precision dots, rounding only. bf16: inputs, weights and the shrink result rounded to 8 significant
# bits (~2^-8 relative each) before float32 accumulation: within 2e-2 of the largest reference entry.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def inputs(seed: int = 0, num_tokens: int = 24):
    x, lora_a, lora_b, token_slot = random_slots(
        seed, num_tokens=num_tokens, in_dim=32, out_dim=24, slot_ranks=SLOT_RANKS, max_rank=8
    )
    token_slot[:3] = (0, 1, 3)  # every case present whatever the seed
    lora = build_lora_batch(token_slot, 4, SLOT_SCALE, np.array(SLOT_RANKS))
    return x, lora_a, lora_b, jax.tree_util.tree_map(jnp.asarray, lora)


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual, np.float64)
    assert np.abs(actual - expected).max() <= TOLERANCE[dtype] * np.abs(expected).max()


def test_shrink_and_expand_pick_each_tokens_own_slot():
    x, lora_a, lora_b, lora = inputs()
    backend = BgmvBackend(None)
    s = jax.jit(backend.shrink)(jnp.asarray(x), jnp.asarray(lora_a), lora)
    slots = np.asarray(lora.token_slot)
    expected_s = np.einsum("ti,tri->tr", x.astype(np.float64), lora_a[slots].astype(np.float64))
    assert s.shape == (24, 8) and s.dtype == jnp.float32
    assert_close(s, expected_s, jnp.float32)
    y = jax.jit(backend.expand, static_argnames="out_dtype")(s, jnp.asarray(lora_b), lora, out_dtype=jnp.float32)
    assert_close(y, np.einsum("tr,tor->to", expected_s, lora_b[slots].astype(np.float64)), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_apply_matches_the_per_token_reference(dtype):
    x, lora_a, lora_b, lora = inputs(seed=1)
    base = np.random.default_rng(2).standard_normal((24, 24)).astype(np.float32)
    out = apply(
        BgmvBackend(None),
        jnp.asarray(x, dtype),
        jnp.asarray(lora_a, dtype),
        jnp.asarray(lora_b, dtype),
        lora,
        base_out=jnp.asarray(base, dtype),
    )
    assert out.dtype == dtype
    rounded = [np.asarray(jnp.asarray(t, dtype), np.float32) for t in (x, lora_a, lora_b)]
    delta = per_token_reference(*rounded, np.asarray(lora.token_slot), SLOT_SCALE)
    assert_close(np.asarray(out, np.float64) - np.asarray(jnp.asarray(base, dtype), np.float64), delta, dtype)
    assert np.abs(delta).max() > 1.0  # the adapters do change the output


def test_tokens_of_no_adapter_keep_the_base_output_exactly():
    x, lora_a, lora_b, lora = inputs(seed=3)
    base = jnp.asarray(np.random.default_rng(4).standard_normal((24, 24)), jnp.float32)
    out = np.asarray(
        apply(BgmvBackend(None), jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b), lora, base_out=base)
    )
    no_adapter = np.asarray(lora.token_slot) == 0
    assert no_adapter.sum() >= 1
    np.testing.assert_array_equal(out[no_adapter], np.asarray(base)[no_adapter])
    assert not np.array_equal(out[~no_adapter], np.asarray(base)[~no_adapter])


def test_a_nan_adapter_reaches_its_own_tokens_only():
    x, lora_a, lora_b, lora = inputs(seed=5)
    lora_a[3, 0, 0] = np.nan
    lora_b[3, 0, 0] = np.inf
    out = np.asarray(apply(BgmvBackend(None), jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b), lora))
    poisoned = np.asarray(lora.token_slot) == 3
    assert not np.isfinite(out[poisoned]).all()
    assert np.isfinite(out[~poisoned]).all()
    lora_a[3], lora_b[3] = 0.0, 0.0
    expected = per_token_reference(x, lora_a, lora_b, np.asarray(lora.token_slot), SLOT_SCALE)
    assert_close(out[~poisoned], expected[~poisoned], jnp.float32)
