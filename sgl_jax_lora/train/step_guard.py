"""What a training step takes and what it may change: the batch checked before the jitted update (`checked_batch`),
and an update kept only when it leaves the trained weights finite (`finite_or_previous` inside the update, then
`raise_if_refused` on the host).

Flow: LoRATrainer.step and FullTrainer.step -> `checked_batch(batch, vocab_size)` (2-D integer ids in the
vocabulary, a loss mask of their shape, finite) -> the jitted update, which ends in `finite_or_previous(new, old,
loss)`: a NaN loss (a diverged run, a mask of NaN) or a non-finite weight after the update (a NaN learning rate)
gives back the weights and optimizer state it started from -> `raise_if_refused(loss, kept)` raises ValueError
naming which, so one bad step never corrupts the adapter the later steps (and the engine it is pushed to) use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def checked_batch(batch: object, vocab_size: int) -> dict:
    """`batch` with input_ids as int32 numpy [B, S] (S >= 2: a step predicts each next token); ValueError naming what
    is wrong. Other arrays pass through to the loss, a loss_mask checked to be input_ids' shape and finite."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError('a training batch is a dict with "input_ids" [B, S] (and what the loss reads: "loss_mask")')
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or ids.shape[1] < 2 or ids.shape[0] < 1:
        raise ValueError(f"input_ids must be [batch, sequence] with a sequence of at least 2 tokens, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"input_ids holds token {bad}, outside the model's vocabulary [0, {vocab_size})")
    checked = {**batch, "input_ids": ids.astype(np.int32)}
    if "loss_mask" in batch:
        mask = np.asarray(batch["loss_mask"], np.float32)
        if mask.shape != ids.shape:
            raise ValueError(f"loss_mask must have input_ids' shape {ids.shape}, got {mask.shape}")
        if not np.isfinite(mask).all():
            raise ValueError("loss_mask holds NaN or Inf; it weighs each token's loss (1 on completion tokens)")
        checked["loss_mask"] = mask
    return checked


def finite_or_previous(new: object, previous: object, loss: jax.Array) -> tuple[object, jax.Array]:
    """(the update's pytree, or `previous` where the loss or any updated leaf is not finite; whether it was kept).
    `new` and `previous` are (weights, optimizer state) pairs of the same structure."""
    weights = jax.tree.leaves(new[0])
    kept = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in weights]))
    return jax.tree.map(lambda n, p: jnp.where(kept, n, p), new, previous), kept


def raise_if_refused(loss: float, kept: bool) -> None:
    """ValueError after an update that `finite_or_previous` refused (the weights are those from before it)."""
    if kept:
        return
    if not math.isfinite(loss):
        raise ValueError(
            f"the loss is {loss}; the update was not applied (the weights are as before this step): check the batch "
            "(a loss_mask of all zeros gives 0, not NaN) and the loss function"
        )
    raise ValueError(
        "the update made a weight NaN or Inf (the loss was finite); it was not applied (the weights are as before "
        "this step): check the optimizer's learning rate and schedule"
    )
