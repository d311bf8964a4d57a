"""sgl_jax_lora/train/step_guard.py: a training batch checked before the update (ids 2-D, integer, in the
vocabulary; a loss mask of their shape, finite), and an update kept only when the loss and the updated weights are
finite, else refused with the weights as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sgl_jax_lora.train.step_guard import checked_batch, guarded_update, raise_if_refused

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


def test_an_update_that_is_not_finite_leaves_params_and_optimizer_state_as_they_were():
    optimizer = optax.adam(0.1)
    params = {"a": jnp.ones(3)}
    state = optimizer.init(params)
    grads = {"a": jnp.ones(3)}
    new_params, new_state, kept = guarded_update(optimizer, params, state, grads, jnp.float32(0.5))
    assert bool(kept) and float(new_params["a"][0]) < 1.0
    refused = [
        (optimizer, grads, jnp.float32(jnp.nan)),  # a diverged loss
        (optax.adam(float("nan")), grads, jnp.float32(0.5)),  # a NaN learning rate: NaN updates
        (optimizer, {"a": jnp.full(3, 1e30)}, jnp.float32(0.5)),  # Adam's second moment overflows, the update not
    ]
    for opt, bad_grads, loss in refused:
        kept_params, kept_state, kept = guarded_update(opt, params, opt.init(params), bad_grads, loss)
        assert not bool(kept)
        np.testing.assert_array_equal(kept_params["a"], params["a"])
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(kept_state))
    with pytest.raises(ValueError, match="the loss is nan; the update was not applied"):
        raise_if_refused(float("nan"), False)
    with pytest.raises(ValueError, match="check the optimizer's learning rate"):
        raise_if_refused(0.5, False)
    raise_if_refused(0.5, True)
