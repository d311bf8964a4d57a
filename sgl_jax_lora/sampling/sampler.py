"""Sampler: logits of the rows to sample -> next token ids and their logprobs, on device.

Flow: ModelRunner computes logits [S, V] for each sequence's last token (with penalties, logit_bias and
min_new_tokens bans applied on the device, only in steps that ask for them; see logit_adjustments.py) -> `sample`
(jitted per S bucket and per (is_greedy, num_top_logprobs)) -> EngineCore._finish reads the tokens on the host.

Randomness is per request: the key of a request's n-th output token is fold_in(key(seed), n), so a
request's samples do not depend on what else is in its batch. Returned logprobs are those of the
(penalized, biased) model distribution before temperature, top-p, top-k and min-p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Prompt logprobs take the logits of this many rows at a time: a step's [T, V] float32 logits (2.1 GB at T = 4096
# with a 128k vocabulary, more with log-softmax and top-k) never exist at once, so the memory the KV cache must
# leave them stays small whatever the largest token bucket.
PROMPT_LOGPROB_ROWS = 512


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
    """Temperature, then top-k, top-p and min-p filtering, then a draw; no sort of the vocabulary. Each filter keeps
    the tokens at or above a per-row probability threshold, found by bisection (`_filter_thresholds`); batches where
    no row filters skip that search (lax.cond)."""
    scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
    filtered = jnp.where(filter_mask(scaled, batch), scaled, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(batch.seeds, batch.steps)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


def filter_mask(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """scaled logits [S, V] (after temperature) -> [S, V] bool: the tokens top-k, top-p and min-p keep."""
    probs = jax.nn.softmax(scaled, axis=-1)
    vocab = scaled.shape[-1]
    filters = jnp.any((batch.top_k > 0) & (batch.top_k < vocab)) | jnp.any(batch.top_p < 1) | jnp.any(batch.min_p > 0)
    threshold = jax.lax.cond(filters, _filter_thresholds, lambda p, b: jnp.zeros(p.shape[:1], p.dtype), probs, batch)
    return probs >= threshold[:, None]


def _filter_thresholds(probs: jax.Array, batch: SamplingBatch) -> jax.Array:
    """probs [S, V] -> [S] the smallest probability a token may have and be kept. A token is kept when fewer than
    top_k tokens are more likely (top-k), the tokens more likely than it hold less than top_p of the mass (top-p,
    the nucleus), and its probability is at least min_p times the largest (min-p), as a descending sort would decide
    (ties aside). Probabilities are non-negative floats, whose bit patterns order as integers, so bisecting the
    threshold's bits finds the exact value in 31 steps of two reductions over the vocabulary each."""
    vocab = probs.shape[-1]
    top_k = jnp.where(batch.top_k > 0, batch.top_k, vocab)
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # [S, V], ordered as the probabilities

    def step(_, bounds):
        lo, hi = bounds  # the threshold lies in (lo, hi]: a token of value hi would be kept, one of value lo not
        mid = lo + (hi - lo) // 2
        above = bits > mid[:, None]
        count = jnp.sum(above, axis=-1)
        mass = jnp.sum(jnp.where(above, probs, 0.0), axis=-1)
        kept = (count < top_k) & ((mass < batch.top_p) | (batch.top_p >= 1))  # would a token of value mid be kept
        # (top_p 1 keeps all: the float sum of all tokens but the least likely may round to 1)
        return jnp.where(kept, lo, mid), jnp.where(kept, mid, hi)

    num_rows = probs.shape[0]
    lo = jnp.full((num_rows,), -1, jnp.int32)
    hi = jnp.max(bits, axis=-1)
    _, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
    threshold = jax.lax.bitcast_convert_type(hi, jnp.float32)
    return jnp.maximum(threshold, batch.min_p * jnp.max(probs, axis=-1))


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


def chunked_token_logprobs(
    logits_of: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    target_ids: jax.Array,
    num_top: int,
    rows_per_chunk: int | None = None,
) -> SampleOutput:
    """`token_logprobs` over hidden [T, E] -> logits_of [C, E] -> [C, V], rows_per_chunk (default
    PROMPT_LOGPROB_ROWS) rows at a time (the rows are padded to a whole number of chunks; the padding's results are
    dropped). Same values as one call."""
    rows_per_chunk = rows_per_chunk or PROMPT_LOGPROB_ROWS
    num_rows = hidden.shape[0]
    if num_rows <= rows_per_chunk:
        return token_logprobs(logits_of(hidden), target_ids, num_top)
    num_chunks = -(-num_rows // rows_per_chunk)
    padding = num_chunks * rows_per_chunk - num_rows
    hidden = jnp.pad(hidden, ((0, padding), (0, 0))).reshape(num_chunks, rows_per_chunk, hidden.shape[1])
    targets = jnp.pad(target_ids, (0, padding)).reshape(num_chunks, rows_per_chunk)
    out = jax.lax.map(lambda chunk: token_logprobs(logits_of(chunk[0]), chunk[1], num_top), (hidden, targets))
    return jax.tree.map(lambda a: a.reshape((num_chunks * rows_per_chunk,) + a.shape[2:])[:num_rows], out)
