"""sgl_jax_lora/train/step_guard.py: a training batch checked before the update (ids 2-D, integer, in the
vocabulary; a loss mask of their shape, finite), and an update kept only when the loss and the updated weights are
finite, else refused with the weights as they were."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.train.step_guard import checked_batch, finite_or_previous, raise_if_refused

IDS = np.array([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize(
    "batch, message",
    [
        ([IDS], "a training batch is a dict"),
        ({"loss_mask": np.ones((2, 3))}, "a training batch is a dict"),
        ({"input_ids": IDS[0]}, r"must be \[batch, sequence\] .* got \(3,\)"),
        ({"input_ids": IDS[:, :1]}, r"at least 2 tokens, got \(2, 1\)"),
        ({"input_ids": IDS.astype(np.float32)}, "integer token ids, got dtype float32"),
        ({"input_ids": IDS + 100}, r"holds token 106, outside the model's vocabulary \[0, 100\)"),
        ({"input_ids": -IDS}, "holds token -6, outside"),
        ({"input_ids": IDS, "loss_mask": np.ones((2, 2))}, r"loss_mask must have input_ids' shape \(2, 3\)"),
        ({"input_ids": IDS, "loss_mask": np.full((2, 3), np.nan)}, "loss_mask holds NaN or Inf"),
    ],
)
def test_a_malformed_batch_is_refused_naming_the_problem(batch, message):
    with pytest.raises(ValueError, match=message):
        checked_batch(batch, vocab_size=100)


def test_a_good_batch_passes_as_int32_and_float32_with_its_other_arrays():
    advantages = np.ones((2, 3))
    batch = checked_batch({"input_ids": IDS.tolist(), "loss_mask": IDS > 2, "advantages": advantages}, 100)
    assert batch["input_ids"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
    assert batch["advantages"] is advantages  # what the loss reads passes through


def test_an_update_that_is_not_finite_gives_back_the_previous_state():
    previous = ({"a": jnp.ones(3)}, {"m": jnp.zeros(3)})
    good = ({"a": jnp.full(3, 2.0)}, {"m": jnp.ones(3)})
    kept_state, kept = finite_or_previous(good, previous, jnp.float32(0.5))
    assert bool(kept) and float(kept_state[0]["a"][0]) == 2.0 and float(kept_state[1]["m"][0]) == 1.0
    bad_weights = ({"a": jnp.array([2.0, jnp.nan, 2.0])}, {"m": jnp.ones(3)})
    for new, loss in ((bad_weights, jnp.float32(0.5)), (good, jnp.float32(jnp.nan))):
        state, kept = finite_or_previous(new, previous, loss)
        assert not bool(kept)
        assert float(state[0]["a"][0]) == 1.0 and float(state[1]["m"][0]) == 0.0  # both halves as before
    with pytest.raises(ValueError, match="the loss is nan; the update was not applied"):
        raise_if_refused(float("nan"), False)
    with pytest.raises(ValueError, match="check the optimizer's learning rate"):
        raise_if_refused(0.5, False)
    raise_if_refused(0.5, True)
