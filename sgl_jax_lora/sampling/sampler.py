"""Sampler: logits of the rows to sample -> next token ids and their logprobs, on device.

Flow: ModelRunner computes logits [S, V] for each sequence's last token (with penalties, logit_bias and
min_new_tokens bans applied on the device, only in steps that ask for them; see logit_adjustments.py) -> `sample`
(as `sample_and_carry`, jitted per S bucket, per mode of `sampling_modes` and per num_top_logprobs) ->
EngineCore._finish reads the tokens on the host.
On a GPU the program holds no control flow: XLA:GPU runs a conditional by copying its predicate to the host and
waiting for it, which would hold the engine loop until the forward before it finished and undo the overlap
schedule. There the host chooses whether the top-k / top-p / min-p search runs (`SamplingBatch.filters`, a meta
field: one more program per bucket, `GPU_SAMPLING_MODES`); on TPU and CPU, whose conditionals and loops run without
the host, the device chooses (`filters` None, `lax.cond`), and the search runs as a loop, which compiles faster
there than its unrolled GPU form, as do the draw's running sums.

Randomness is per request: the key of a request's n-th output token is fold_in(key(seed), n), so a
request's samples do not depend on what else is in its batch. Returned logprobs are those of the
(penalized, biased) model distribution before temperature, top-p, top-k and min-p.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

# Prompt logprobs take the logits of this many rows at a time: a step's [T, V] float32 logits (2.1 GB at T = 4096
# with a 128k vocabulary, more with log-softmax and top-k) never exist at once, so the memory the KV cache must
# leave them stays small whatever the largest token bucket.
PROMPT_LOGPROB_ROWS = 512
# The draw's levels (`draw`): tokens a block, blocks a group (at most).
DRAW_BLOCK = 128
DRAW_GROUP = 32


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
    # meta: whether the threshold search runs, chosen on the host (True: some sampled row has top_k, top_p or min_p)
    # or None: on the device, by a conditional (`sampling_modes`)
    filters: bool | None


jax.tree_util.register_dataclass(
    SamplingBatch,
    data_fields=["temperature", "top_p", "top_k", "min_p", "seeds", "steps"],
    meta_fields=["is_greedy", "num_top_logprobs", "filters"],
)
# (is_greedy, filters) of the sampling programs a sequence bucket compiles: greedy, then sampled with the search
# chosen on the host (sampled, sampled and filtered) on a GPU, or on the device elsewhere.
GPU_SAMPLING_MODES = ((True, False), (False, False), (False, True))
DEVICE_CHOICE_SAMPLING_MODES = ((True, None), (False, None))


def sampling_modes(platform: str) -> tuple[tuple[bool, bool | None], ...]:
    """The (is_greedy, filters) modes the sampler compiles on devices of `platform` ('gpu', 'tpu', 'cpu')."""
    return GPU_SAMPLING_MODES if platform == "gpu" else DEVICE_CHOICE_SAMPLING_MODES


def for_modes(batch: SamplingBatch, modes: tuple[tuple[bool, bool | None], ...]) -> SamplingBatch:
    """The batch as the sampling programs of `modes` (`sampling_modes`) take it: the host's choice of the filter
    search kept where the host chooses (a GPU), left to the program (None) elsewhere."""
    return batch if modes[-1][1] is not None else dataclasses.replace(batch, filters=None)


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


def sample_and_carry(max_rows: int, replicated: NamedSharding, logits: jax.Array, batch: SamplingBatch):
    """`sample`, and its ids padded with zeros to [max_rows] under the `replicated` sharding: the next forward reads
    the tokens in flight from them (ModelRunner's sampling program)."""
    out = sample(logits, batch)
    carried = jnp.zeros((max_rows,), jnp.int32).at[: out.next_ids.shape[0]].set(out.next_ids)
    return out, jax.lax.with_sharding_constraint(carried, replicated)


def _sample_filtered(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Temperature, then top-k, top-p and min-p filtering, then a draw; no sort of the vocabulary. Each filter keeps
    the tokens at or above a per-row probability threshold (`_filter_thresholds`); batches where no row filters
    skip that search (`_thresholds`). The draw takes one uniform number a row (`draw`)."""
    scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    kept = jnp.where(probs >= _thresholds(probs, batch)[:, None], probs, 0.0)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(batch.seeds, batch.steps)
    return draw(keys, kept, loops=_device_runs_loops(batch))


def filter_mask(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """scaled logits [S, V] (after temperature) -> [S, V] bool: the tokens top-k, top-p and min-p keep."""
    probs = jax.nn.softmax(scaled, axis=-1)
    return probs >= _thresholds(probs, batch)[:, None]


def _thresholds(probs: jax.Array, batch: SamplingBatch) -> jax.Array:
    """probs [S, V] -> [S] each row's filter threshold; zeros (keep all) without a search when no row filters: as the
    host chose (`batch.filters`), or, when it left the choice to the device (None), by a conditional."""

    def keep_all(p: jax.Array, _: SamplingBatch) -> jax.Array:
        return jnp.zeros(p.shape[:1], p.dtype)

    if batch.filters is not None:
        return (_filter_thresholds if batch.filters else keep_all)(probs, batch)
    vocab = probs.shape[-1]
    filters = jnp.any((batch.top_k > 0) & (batch.top_k < vocab)) | jnp.any(batch.top_p < 1) | jnp.any(batch.min_p > 0)
    return jax.lax.cond(filters, _filter_thresholds, keep_all, probs, batch)


def draw(keys: jax.Array, weights: jax.Array, loops: bool = False) -> jax.Array:
    """keys [S] (one PRNG key a row), weights [S, V] non-negative, each row's sum positive -> [S] i32: index i drawn
    with probability weights[i] / sum. By the inverse of the cumulative sum at one uniform number a row, found in
    three levels: groups of up to DRAW_GROUP blocks of DRAW_BLOCK tokens (the blocks' sums take one pass over the
    weights), then the blocks of the chosen group, then the tokens of the chosen block, each level a running sum
    over a few entries (`_choose`). Never a zero-weight token: where float rounding leaves the number past the last
    sum, the last entry of positive weight is taken at each level. loops: the running sums as `jnp.cumsum`, which
    may lower to a loop (`_device_runs_loops`) and runs fastest on a CPU; otherwise as masked reductions, which hold
    no loop and no scan and compile in a fraction of a parallel scan's time on a GPU."""
    running_sums = functools.partial(jnp.cumsum, axis=-1) if loops else _masked_running_sums
    num_rows, vocab = weights.shape
    num_blocks = -(-vocab // DRAW_BLOCK)
    blocks_per_group = min(DRAW_GROUP, num_blocks)
    num_groups = -(-num_blocks // blocks_per_group)
    blocks = jnp.pad(weights, ((0, 0), (0, num_blocks * DRAW_BLOCK - vocab))).reshape(num_rows, num_blocks, DRAW_BLOCK)
    # the blocks' sums padded to whole groups with zeros (never chosen), not the weights: XLA:CPU took 281 ms to sum
    # 256 rows of 128,256 weights padded to 32 groups, against 12 ms for the whole draw this way
    block_sums = jnp.pad(jnp.sum(blocks, axis=-1), ((0, 0), (0, num_groups * blocks_per_group - num_blocks)))
    group_sums = jnp.sum(block_sums.reshape(num_rows, num_groups, blocks_per_group), axis=-1)  # [S, G]
    target = jax.vmap(jax.random.uniform)(keys) * jnp.sum(group_sums, axis=-1)  # [S] in [0, sum)
    group, target = _choose(group_sums, target, running_sums)
    first_block = group * blocks_per_group
    group_blocks = first_block[:, None] + jnp.arange(blocks_per_group)[None, :]
    block, target = _choose(jnp.take_along_axis(block_sums, group_blocks, axis=-1), target, running_sums)
    block = first_block + block
    tokens = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [S, DRAW_BLOCK]
    index, _ = _choose(tokens, target, running_sums)
    # a row with no positive weight (NaN logits) would end on the padding past the vocabulary: keep it inside
    return jnp.minimum(block * DRAW_BLOCK + index, vocab - 1).astype(jnp.int32)


def _choose(
    values: jax.Array, target: jax.Array, running_sums: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """values [S, N] non-negative, target [S] -> (index [S], the target less the values before the index): the entry
    whose running sum first passes the target, or the last positive entry where rounding left the target past them
    all (each running sum of `running_sums` adds the same terms in the same order, so a zero entry never passes)."""
    running = running_sums(values)
    index = jnp.minimum(jnp.sum(running <= target[:, None], axis=-1), _last_positive(values))
    before = jnp.where(index > 0, jnp.take_along_axis(running, jnp.maximum(index - 1, 0)[:, None], axis=-1)[:, 0], 0)
    return index, target - before


def _masked_running_sums(values: jax.Array) -> jax.Array:
    """[S, N] -> [S, N] each row's running sums, entry i the masked sum of entries 0..i: N sums of N terms, for the
    few entries of a draw's level. Non-decreasing along the row whatever the rounding (each sum adds the same terms
    in the same order, later ones in place of zeros), and level where a zero is added."""
    size = values.shape[-1]
    upto = jnp.arange(size)[None, :] <= jnp.arange(size)[:, None]  # [N, N]: upto[i, j] = j <= i
    return jnp.sum(jnp.where(upto[None], values[:, None, :], 0.0), axis=-1)


def _device_runs_loops(batch: SamplingBatch) -> bool:
    """Whether the sampling program may hold loops: where the device chooses the filter search (`batch.filters`
    None: TPU, CPU), whose loops run without the host; not where the host chose it (a GPU), whose program holds no
    control flow."""
    return batch.filters is None


def _last_positive(values: jax.Array) -> jax.Array:
    """[S, N] -> [S] the index of each row's last positive entry."""
    return values.shape[-1] - 1 - jnp.argmax(values[:, ::-1] > 0, axis=-1)


def _filter_thresholds(probs: jax.Array, batch: SamplingBatch) -> jax.Array:
    """probs [S, V] -> [S] the smallest probability a token may have and be kept. A token is kept when fewer than
    top_k tokens are more likely (top-k), the tokens more likely than it hold less than top_p of the mass (top-p,
    the nucleus), and its probability is at least min_p times the largest (min-p), as a descending sort would decide
    (ties aside). Probabilities are non-negative floats, whose bit patterns order as integers, so bisecting the
    threshold's bits finds the exact value in 32 steps of two reductions over the vocabulary each. Each step reads
    the probabilities alone and takes their bits inside the reduction: a bits array made once beside them would be
    a second [S, V] array to read every step. Where the host chose to run the search (`batch.filters`, a GPU) the
    steps are unrolled: no loop for XLA:GPU to run from the host. Where the device chooses (TPU, CPU) they run as a
    loop, which those devices run on their own: unrolled inside the conditional, XLA:CPU compiled the sampling
    program of 8 rows in 1.7 s for a 491-token vocabulary and 6 s for a 7-token one with JAX 0.10.2, and did not
    finish the latter in 100 s with JAX 0.11.2 (as a loop: under 1 s each)."""
    vocab = probs.shape[-1]
    top_k = jnp.where(batch.top_k > 0, batch.top_k, vocab)

    def step(bounds):
        lo, hi = bounds  # the threshold lies in (lo, hi]: a token of value hi would be kept, one of value lo not
        mid = lo + (hi - lo) // 2
        above = jax.lax.bitcast_convert_type(probs, jnp.int32) > mid[:, None]  # bits order as the probabilities
        count = jnp.sum(above, axis=-1)
        mass = jnp.sum(jnp.where(above, probs, 0.0), axis=-1)
        kept = (count < top_k) & ((mass < batch.top_p) | (batch.top_p >= 1))  # would a token of value mid be kept
        # (top_p 1 keeps all: the float sum of all tokens but the least likely may round to 1)
        return jnp.where(kept, lo, mid), jnp.where(kept, mid, hi)

    num_rows = probs.shape[0]
    lo = jnp.full((num_rows,), -1, jnp.int32)
    hi = jnp.max(jax.lax.bitcast_convert_type(probs, jnp.int32), axis=-1)
    bounds = (lo, hi)
    if _device_runs_loops(batch):
        bounds = jax.lax.fori_loop(0, 32, lambda _, bounds: step(bounds), bounds)
    else:
        for _ in range(32):
            bounds = step(bounds)
    hi = bounds[1]
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
