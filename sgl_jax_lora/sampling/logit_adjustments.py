"""Logit adjustments on the device: penalties, logit_bias and min_new_tokens bans, for the rows that ask.

Flow: EngineCore describes each sampling request that adjusts its logits as a `LogitRow` (most steps have none) ->
`pack_logit_rows` turns the step's rows into a `LogitAdjustments` of small flat arrays, one entry per (row, token id)
that some rule touches, padded to an entry bucket (configs/buckets.py) -> ModelRunner's logits program applies
`apply_logit_adjustments` right after the LM head, on the device -> `sampler.sample`. The [S, V] logits never leave
the device.

Order, per row: repetition penalty (over prompt and output tokens, as in HF: a positive logit is divided by it, a
negative one multiplied), then frequency and presence penalties (over output tokens, as in OpenAI: minus frequency
times the count, minus presence once), then logit_bias (added), then the ban of stop and EOS ids while a request is
short of `min_new_tokens` (-inf). Sampled logprobs are those of the adjusted distribution.

Under the overlap schedule a request's last output token may still be in flight (sampled by the step before, not on
the host yet). Its row then names where that token lies in the previous step's sampled ids (`in_flight_row`), and
the device counts it as an output token: it adds one to the entry of that token id, or makes a new entry when the
host sent none.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax_lora.configs.buckets import pick
from sgl_jax_lora.sampling.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class LogitRow:
    """One sampling request's logit adjustments, as the host knows them."""

    prompt_ids: list[int]
    output_ids: list[int]  # output tokens on the host (not the one in flight)
    params: SamplingParams
    banned_ids: tuple[int, ...] = ()  # may not be sampled this step: stop and EOS ids before min_new_tokens
    in_flight_row: int = -1  # row of the previous step's sampled ids holding its newest output token; -1: none

    @property
    def adjusts(self) -> bool:
        return self.params.adjusts_logits or bool(self.banned_ids)


@dataclasses.dataclass(frozen=True)
class LogitAdjustments:
    # One entry per (logits row, token id) a rule touches; each pair at most once. N = an entry bucket.
    rows: jax.Array  # [N] i32           logits row of the entry; S (out of range) = padding, dropped
    token_ids: jax.Array  # [N] i32      its token id (ids >= V are dropped)
    output_counts: jax.Array  # [N] f32  times the token is among the row's output tokens on the host
    seen: jax.Array  # [N] bool          in the prompt or the output (the repetition penalty applies)
    bias: jax.Array  # [N] f32           logit_bias of the token, 0 when none
    banned: jax.Array  # [N] bool        may not be sampled (min_new_tokens)
    # Per logits row; neutral values (1, 0, 0, -1) on rows that do not adjust and on padding.
    repetition_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    presence_penalty: jax.Array  # [S] f32
    in_flight_row: jax.Array  # [S] i32  row of prev_ids holding an output token still in flight; -1: none


jax.tree_util.register_dataclass(
    LogitAdjustments,
    data_fields=[f.name for f in dataclasses.fields(LogitAdjustments)],
    meta_fields=[],
)


ROW_SHIFT = 32  # an entry's key on the host: row << ROW_SHIFT | token id (token ids are int32)


def _keys(row_index: int, ids: list[int] | tuple[int, ...]) -> np.ndarray:
    return np.fromiter(ids, np.int64, len(ids)) | (row_index << ROW_SHIFT)


def pack_logit_rows(
    rows: list[LogitRow | None], num_seqs: int, entry_sizes: tuple[int, ...]
) -> LogitAdjustments | None:
    """rows[s] for logits row s (None: no adjustment) -> numpy LogitAdjustments padded to the smallest of
    `entry_sizes` that holds every entry; None when no row adjusts (the logits program then skips the work).

    All rows are packed at once: every (row, token id) occurrence becomes one int64 key with its contribution (prompt
    occurrence, output occurrence, bias, ban); one sort groups equal keys and sums their contributions, so the host's
    cost grows with the step's tokens, not with its rows times a per-row overhead."""
    adjusting = [(s, row) for s, row in enumerate(rows) if row is not None and row.adjusts]
    if not adjusting:
        return None
    parts: dict[str, list[np.ndarray]] = {"prompt": [], "output": [], "bias": [], "banned": []}
    bias_values = []
    for s, row in adjusting:
        params = row.params
        if params.uses_penalties:
            parts["output"].append(_keys(s, row.output_ids))
            if params.repetition_penalty != 1:
                parts["prompt"].append(_keys(s, row.prompt_ids))
        parts["bias"].append(_keys(s, tuple(params.logit_bias)))
        bias_values.append(np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))
        parts["banned"].append(_keys(s, row.banned_ids))
    keys = [np.concatenate(arrays) if arrays else np.zeros(0, np.int64) for arrays in parts.values()]
    occurrences = np.concatenate(keys)
    order = np.argsort(occurrences)
    sorted_keys = occurrences[order]
    starts = np.flatnonzero(np.diff(sorted_keys, prepend=-1))  # the first occurrence of each key (keys are >= 0)
    offsets = np.cumsum([0] + [k.size for k in keys])

    def summed(part: int, values: np.ndarray | float = 1.0) -> np.ndarray:
        """Per entry, the sum of `values` over its occurrences in part `part` (0 prompt, 1 output, 2 bias, 3 banned)."""
        contribution = np.zeros(occurrences.size, np.float32)
        contribution[offsets[part] : offsets[part + 1]] = values
        return np.add.reduceat(contribution[order], starts) if starts.size else contribution[:0]

    n = starts.size
    packed = padding_logit_adjustments(num_seqs, pick(entry_sizes, n))
    entry_keys = sorted_keys[starts]
    packed.rows[:n], packed.token_ids[:n] = entry_keys >> ROW_SHIFT, entry_keys & (2**ROW_SHIFT - 1)
    packed.output_counts[:n] = summed(1)
    packed.seen[:n] = (summed(0) > 0) | (packed.output_counts[:n] > 0)
    packed.bias[:n] = summed(2, np.concatenate(bias_values))
    packed.banned[:n] = summed(3) > 0
    for s, row in adjusting:
        packed.repetition_penalty[s] = row.params.repetition_penalty
        packed.frequency_penalty[s] = row.params.frequency_penalty
        packed.presence_penalty[s] = row.params.presence_penalty
        packed.in_flight_row[s] = row.in_flight_row
    return packed


def padding_logit_adjustments(num_seqs: int, num_entries: int) -> LogitAdjustments:
    """Adjustments that change nothing, of S = num_seqs rows and N = num_entries entries (numpy, writable)."""
    return LogitAdjustments(
        rows=np.full(num_entries, num_seqs, np.int32),
        token_ids=np.zeros(num_entries, np.int32),
        output_counts=np.zeros(num_entries, np.float32),
        seen=np.zeros(num_entries, bool),
        bias=np.zeros(num_entries, np.float32),
        banned=np.zeros(num_entries, bool),
        repetition_penalty=np.ones(num_seqs, np.float32),
        frequency_penalty=np.zeros(num_seqs, np.float32),
        presence_penalty=np.zeros(num_seqs, np.float32),
        in_flight_row=np.full(num_seqs, -1, np.int32),
    )


def apply_logit_adjustments(logits: jax.Array, adj: LogitAdjustments, prev_ids: jax.Array) -> jax.Array:
    """logits [S, V] f32, prev_ids [M] i32 (the previous step's sampled ids) -> adjusted logits [S, V].

    Gathers the logit of each entry, applies the rules in order and scatters the results back: the work and the
    memory are per entry, not per [S, V]."""
    num_seqs = logits.shape[0]
    in_flight = jnp.where(adj.in_flight_row >= 0, prev_ids[jnp.maximum(adj.in_flight_row, 0)], -1)  # [S]
    entry_in_flight = jnp.take(in_flight, adj.rows, mode="fill", fill_value=-1)  # [N]; padding rows: -1
    is_in_flight = (adj.token_ids == entry_in_flight) & (entry_in_flight >= 0)
    covered = jnp.zeros(num_seqs, jnp.int32).at[adj.rows].max(is_in_flight.astype(jnp.int32), mode="drop") > 0
    new_entry = (in_flight >= 0) & ~covered  # the in-flight token has no entry of the host's: one more per row
    rows = jnp.concatenate([adj.rows, jnp.where(new_entry, jnp.arange(num_seqs, dtype=jnp.int32), num_seqs)])
    token_ids = jnp.concatenate([adj.token_ids, jnp.maximum(in_flight, 0)])
    counts = jnp.concatenate([adj.output_counts + is_in_flight, jnp.ones(num_seqs, jnp.float32)])
    seen = jnp.concatenate([adj.seen | is_in_flight, jnp.ones(num_seqs, bool)])
    bias = jnp.concatenate([adj.bias, jnp.zeros(num_seqs, jnp.float32)])
    banned = jnp.concatenate([adj.banned, jnp.zeros(num_seqs, bool)])

    def per_entry(values: jax.Array, fill: float) -> jax.Array:
        return jnp.take(values, rows, mode="fill", fill_value=fill)

    values = logits.at[rows, token_ids].get(mode="fill", fill_value=0.0)
    penalty = per_entry(adj.repetition_penalty, 1.0)
    values = jnp.where(seen, jnp.where(values > 0, values / penalty, values * penalty), values)
    values = values - (
        per_entry(adj.frequency_penalty, 0.0) * counts + per_entry(adj.presence_penalty, 0.0) * (counts > 0)
    )
    values = jnp.where(banned, -jnp.inf, values + bias)
    return logits.at[rows, token_ids].set(values, mode="drop")
