"""Sampler: logits of the rows to sample -> next token ids and their logprobs, on device.

Flow: ModelRunner computes logits [S, V] for each sequence's last token -> (host-side penalties and
logit_bias, only for batches that ask for them; see logit_adjustments.py) -> `sample` (jitted per S bucket and per
(is_greedy, num_top_logprobs)) -> EngineCore._finish reads the tokens on the host.

Randomness is per request: the key of a request's n-th output token is fold_in(key(seed), n), so a
request's samples do not depend on what else is in its batch. Returned logprobs are those of the
(penalized, biased) model distribution before temperature, top-p, top-k and min-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp



@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    temperature: jax.Array  # [S] f32   0 = greedy
    top_p: jax.Array  # [S] f32
    top_k: jax.Array  # [S] i32         <= 0: off
    min_p: jax.Array  # [S] f32
    seeds: jax.Array  # [S] u32
    steps: jax.Array  # [S] i32         number of output tokens the request already has
    is_greedy: bool  # meta: every row greedy -> argmax only
    num_top_logprobs: int  # meta: 0 or MAX_TOP_LOGPROBS


jax.tree_util.register_dataclass(
    SamplingBatch,
    data_fields=["temperature", "top_p", "top_k", "min_p", "seeds", "steps"],
    meta_fields=["is_greedy", "num_top_logprobs"],
)


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    next_ids: jax.Array  # [S] i32
    next_logprobs: jax.Array  # [S] f32
    top_ids: jax.Array  # [S, K] i32 (K = num_top_logprobs, may be 0)
    top_logprobs: jax.Array  # [S, K] f32


jax.tree_util.register_dataclass(
    SampleOutput, data_fields=["next_ids", "next_logprobs", "top_ids", "top_logprobs"], meta_fields=[]
)


def sample(logits: jax.Array, batch: SamplingBatch) -> SampleOutput:
    """logits [S, V] f32 -> SampleOutput."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if batch.is_greedy:
        next_ids = greedy_ids
    else:
        sampled = _sample_filtered(logits, batch)
        next_ids = jnp.where(batch.temperature > 0, sampled, greedy_ids)
    next_logprobs = jnp.take_along_axis(logprobs, next_ids[:, None], axis=-1)[:, 0]
    if batch.num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, batch.num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleOutput(next_ids, next_logprobs, top_ids.astype(jnp.int32), top_logprobs)


def _sample_filtered(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Temperature, then top-k, top-p and min-p filtering over the sorted distribution, then a draw."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [S, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    top_k = jnp.where(batch.top_k > 0, batch.top_k, vocab)[:, None]
    cumulative = jnp.cumsum(sorted_probs, axis=-1)
    keep = (rank < top_k) & ((cumulative - sorted_probs) < batch.top_p[:, None])
    keep &= sorted_probs >= batch.min_p[:, None] * sorted_probs[:, :1]
    keep = keep.at[:, 0].set(True)
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(batch.seeds, batch.steps)
    choice = jax.vmap(jax.random.categorical)(keys, filtered)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def token_logprobs(logits: jax.Array, target_ids: jax.Array, num_top: int) -> SampleOutput:
    """Prompt logprobs: logits [T, V], target_ids [T] -> logprob of each target and the top-`num_top`."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, target_ids[:, None], axis=-1)[:, 0]
    if num_top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleOutput(target_ids, target, top_ids.astype(jnp.int32), top_logprobs)
