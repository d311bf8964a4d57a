"""sgl_jax_lora/lora/backend/bgmv.py: BgmvBackend's shrink, expand and whole per-token LoRA match a numpy loop over
the tokens (y_t += scale[slot_t] * (x_t @ A[slot_t].T) @ B[slot_t].T) in float32 and bfloat16; tokens of no adapter
(slot 0) keep the base output bit for bit, and a NaN adapter reaches its own tokens only."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from tests.support.lora_backends import (
    SLOT_SCALE,
    apply,
    assert_close,
    check_apply_matches_the_per_token_reference,
    check_shrink_and_expand,
    check_tokens_of_no_adapter_keep_the_base_output,
    per_token_reference,
    run_eagerly,
    slot_inputs,
)


def test_shrink_and_expand_pick_each_tokens_own_slot():
    check_shrink_and_expand(BgmvBackend(None))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_apply_matches_the_per_token_reference(dtype):
    check_apply_matches_the_per_token_reference(run_eagerly(BgmvBackend(None)), dtype)


def test_tokens_of_no_adapter_keep_the_base_output_exactly():
    check_tokens_of_no_adapter_keep_the_base_output(run_eagerly(BgmvBackend(None)))


def test_a_nan_adapter_reaches_its_own_tokens_only():
    x, lora_a, lora_b, lora = slot_inputs(seed=5)
    lora_a[3, 0, 0] = np.nan
    lora_b[3, 0, 0] = np.inf
    out = np.asarray(apply(BgmvBackend(None), jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b), lora))
    poisoned = np.asarray(lora.token_slot) == 3
    assert not np.isfinite(out[poisoned]).all()
    assert np.isfinite(out[~poisoned]).all()
    lora_a[3], lora_b[3] = 0.0, 0.0
    expected = per_token_reference(x, lora_a, lora_b, np.asarray(lora.token_slot), SLOT_SCALE)
    assert_close(out[~poisoned], expected[~poisoned], jnp.float32)
