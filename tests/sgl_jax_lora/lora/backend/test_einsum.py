"""sgl_jax_lora/lora/backend/einsum.py: EinsumBackend's shrink, expand and whole LoRA (every token against every
slot, then each token's own slot selected) match a numpy loop over the tokens (y_t += scale[slot_t] *
(x_t @ A[slot_t].T) @ B[slot_t].T) in float32 and bfloat16; tokens of no adapter (slot 0) keep the base output bit
for bit; a NaN or Inf in one slot changes no other slot's tokens (own_slot selects, finite_or_zero zeroes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.lora.backend.einsum import EinsumBackend, finite_or_zero, own_slot
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from tests.support.lora_backends import (
    SLOT_RANKS,
    SLOT_SCALE,
    apply,
    check_apply_matches_the_per_token_reference,
    check_shrink_and_expand,
    check_tokens_of_no_adapter_keep_the_base_output,
    run_eagerly,
    slot_inputs,
)


def test_shrink_and_expand_pick_each_tokens_own_slot():
    check_shrink_and_expand(EinsumBackend(None))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_apply_matches_the_per_token_reference(dtype):
    check_apply_matches_the_per_token_reference(run_eagerly(EinsumBackend(None)), dtype)


def test_tokens_of_no_adapter_keep_the_base_output_exactly():
    check_tokens_of_no_adapter_keep_the_base_output(run_eagerly(EinsumBackend(None)))


def test_a_nan_or_inf_slot_changes_no_other_slots_tokens():
    x, lora_a, lora_b, lora = slot_inputs(seed=5)
    clean = apply(EinsumBackend(None), jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b), lora)
    lora_a[3, 0, 0] = np.nan
    lora_b[2, 0, 0] = np.inf
    out = np.asarray(apply(EinsumBackend(None), jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b), lora))
    slots = np.asarray(lora.token_slot)
    untouched = (slots == 0) | (slots == 1)
    np.testing.assert_array_equal(out[untouched], np.asarray(clean)[untouched])
    assert not np.isfinite(out[slots == 3]).any()  # its own NaN reaches every column of its own tokens


def test_own_slot_and_finite_or_zero():
    lora = build_lora_batch(np.array([2, 0, 1, 2]), 3, SLOT_SCALE, np.array(SLOT_RANKS))
    mine = np.asarray(own_slot(jax.tree_util.tree_map(jnp.asarray, lora), 4))
    expected = np.zeros((4, 4), bool)
    expected[[0, 1, 2, 3], [2, 0, 1, 2]] = True
    np.testing.assert_array_equal(mine, expected)
    for dtype in (jnp.float32, jnp.bfloat16):
        weights = jnp.asarray([[1.5, np.nan], [-np.inf, np.inf], [-2.0, 0.0]], dtype)
        cleaned = finite_or_zero(weights)
        assert cleaned.dtype == dtype
        np.testing.assert_array_equal(np.asarray(cleaned, np.float32), [[1.5, 0.0], [0.0, 0.0], [-2.0, 0.0]])
