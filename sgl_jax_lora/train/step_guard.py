"""What a training step takes and what it may change: the batch checked before the jitted update (`checked_batch`),
and an update kept only when it is finite (`guarded_update` inside the jitted step, then `raise_if_refused` on the
host).

Flow: LoRATrainer.step and FullTrainer.step -> `checked_batch(batch, vocab_size)` (2-D integer ids in the
vocabulary, a loss mask of their shape, finite) -> the jitted update, whose optax step is `guarded_update`: a NaN
loss (a diverged run), a non-finite update (a NaN learning rate) or a non-finite optimizer state (a gradient that
overflows Adam's second moment) leaves the weights and the optimizer state as they were -> `raise_if_refused(loss,
kept)` raises ValueError naming which, so one bad step never corrupts the adapter the later steps (and the engine it
is pushed to) use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax


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


def guarded_update(
    optimizer: optax.GradientTransformation, params: object, opt_state: object, grads: object, loss: jax.Array
) -> tuple[object, object, jax.Array]:
    """(new params, new optimizer state, whether the update was kept): one optax update, applied only where the loss,
    the updates and the new optimizer state are all finite; else the params stay as they were (a zero update, so the
    add still runs in place on the donated params) and the optimizer state is the previous one."""
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    checked = [*jax.tree.leaves(updates), *_float_leaves(new_opt_state)]
    kept = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in checked]))
    updates = jax.tree.map(lambda u: jnp.where(kept, u, jnp.zeros_like(u)), updates)
    opt_state = jax.tree.map(lambda n, p: jnp.where(kept, n, p), new_opt_state, opt_state)
    return optax.apply_updates(params, updates), opt_state, kept


def _float_leaves(tree: object) -> list:
    return [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact)]


def raise_if_refused(loss: float, kept: bool) -> None:
    """ValueError after an update that `guarded_update` refused (the weights are those from before it)."""
    if kept:
        return
    if not math.isfinite(loss):
        raise ValueError(
            f"the loss is {loss}; the update was not applied (the weights are as before this step): check the batch "
            "(a loss_mask of all zeros gives 0, not NaN) and the loss function"
        )
    raise ValueError(
        "the update (or the optimizer's state) held NaN or Inf though the loss was finite; it was not applied (the "
        "weights are as before this step): check the optimizer's learning rate and schedule, and the gradients' size"
    )
