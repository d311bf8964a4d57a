"""Logit adjustments on the device (sampling/logit_adjustments.py) against a numpy reference, over random rows.

The reference applies the rules to whole [S, V] rows on the host, in the documented order: repetition penalty over
the prompt and output ids (HF), frequency and presence penalties over the output ids (OpenAI), logit_bias, then the
min_new_tokens ban. The device version gets only the packed entries; a row's newest output token may be in flight,
known to the device alone through the previous step's sampled ids, and the reference counts it as an output token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.configs.buckets import logit_entry_budgets
from sgl_jax_lora.sampling.logit_adjustments import LogitRow, apply_logit_adjustments, pack_logit_rows
from sgl_jax_lora.sampling.sampling_params import SamplingParams

VOCAB = 97


def reference_adjust(logits: np.ndarray, rows: list[LogitRow | None], in_flight_ids: list[int | None]) -> np.ndarray:
    """logits [S, V]; rows[s] as packed; in_flight_ids[s]: the row's token still in flight, or None."""
    logits = np.array(logits, dtype=np.float32, copy=True)
    vocab = logits.shape[1]
    for s, row in enumerate(rows):
        if row is None or not row.adjusts:
            continue
        params = row.params
        output_ids = list(row.output_ids) + ([in_flight_ids[s]] if in_flight_ids[s] is not None else [])
        if params.repetition_penalty != 1:
            seen = np.unique(np.asarray(row.prompt_ids + output_ids, dtype=np.int64))
            values = logits[s, seen]
            penalty = np.float32(params.repetition_penalty)
            logits[s, seen] = np.where(values > 0, values / penalty, values * penalty)
        if output_ids and (params.frequency_penalty or params.presence_penalty):
            counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float32)
            logits[s] -= np.float32(params.frequency_penalty) * counts + np.float32(params.presence_penalty) * (
                counts > 0
            )
        if params.logit_bias:
            token_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            logits[s, token_ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
        if row.banned_ids:
            logits[s, [t for t in row.banned_ids if t < vocab]] = -np.inf
    return logits


def random_row(rng: np.random.Generator, prev_row: int) -> tuple[LogitRow | None, int | None]:
    """A row with some of the adjustments (or none), ids drawn from few values (repeats) and the vocabulary's edges;
    -> (row, its token in flight or None)."""
    if rng.random() < 0.2:
        return None, None
    edge_ids = [0, 1, VOCAB - 2, VOCAB - 1]

    def ids(n: int) -> list[int]:
        pool = np.concatenate([rng.integers(0, VOCAB, 6), edge_ids])
        return [int(t) for t in rng.choice(pool, n)]

    uses = rng.random(5) < 0.5  # repetition, frequency, presence, bias, ban
    params = SamplingParams(
        repetition_penalty=float(rng.choice([0.7, 1.3, 2.0])) if uses[0] else 1.0,
        frequency_penalty=float(rng.uniform(-2, 2)) if uses[1] else 0.0,
        presence_penalty=float(rng.uniform(-2, 2)) if uses[2] else 0.0,
        logit_bias={t: float(rng.uniform(-100, 100)) for t in ids(4)} if uses[3] else {},
    )
    banned = tuple(sorted(set(ids(3)) | ({VOCAB + 5} if rng.random() < 0.3 else set()))) if uses[4] else ()
    in_flight = int(ids(1)[0]) if params.uses_penalties and rng.random() < 0.6 else None
    row = LogitRow(
        ids(int(rng.integers(1, 12))),
        ids(int(rng.integers(0, 10))),
        params,
        banned,
        prev_row if in_flight is not None else -1,
    )
    return row, in_flight


@pytest.mark.parametrize("seed", range(6))
def test_device_adjustments_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    num_seqs, max_prev = 8, 16
    prev_ids = np.zeros(max_prev, np.int32)
    rows, in_flight_ids = [], []
    for s in range(num_seqs - 1):  # the last row is padding
        row, in_flight = random_row(rng, prev_row=(s * 5 + 3) % max_prev)
        if in_flight is not None:
            prev_ids[row.in_flight_row] = in_flight
        rows.append(row)
        in_flight_ids.append(in_flight)
    rows.append(None)
    in_flight_ids.append(None)
    logits = (rng.standard_normal((num_seqs, VOCAB)) * 3).astype(np.float32)
    sizes = tuple(num_seqs * b for b in logit_entry_budgets(VOCAB))
    packed = pack_logit_rows(rows, num_seqs, sizes)
    want = reference_adjust(logits, rows, in_flight_ids)
    if packed is None:
        assert all(r is None or not r.adjusts for r in rows)
        return
    got = np.asarray(apply_logit_adjustments(jnp.asarray(logits), packed, jnp.asarray(prev_ids)))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_the_in_flight_token_counts_once_whether_or_not_the_host_sent_its_id():
    # output ids on the host [3, 3]; in flight: 3 again (an entry of the host's gains one) or 9 (a new entry)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = np.full((2, 12), 4.0, np.float32)
    rows = [LogitRow([7], [3, 3], params, in_flight_row=0), LogitRow([7], [3, 3], params, in_flight_row=1)]
    packed = pack_logit_rows(rows, 2, (32,))
    got = np.asarray(apply_logit_adjustments(jnp.asarray(logits), packed, jnp.asarray([3, 9], jnp.int32)))
    assert got[0, 3] == pytest.approx(4.0 / 2 - 0.5 * 3 - 0.25) and got[0, 9] == 4.0
    assert got[1, 3] == pytest.approx(4.0 / 2 - 0.5 * 2 - 0.25) and got[1, 9] == pytest.approx(4.0 / 2 - 0.5 - 0.25)
    assert got[0, 7] == got[1, 7] == 2.0  # prompt id: the repetition penalty only
    assert got[0, 0] == got[1, 11] == 4.0


def test_rows_without_adjustments_pack_to_nothing():
    plain = LogitRow([1, 2], [3], SamplingParams())
    assert pack_logit_rows([None, plain], 2, (32,)) is None
    assert pack_logit_rows([LogitRow([1], [2], SamplingParams(), banned_ids=(5,))], 1, (16,)) is not None


def test_entries_pick_the_smallest_bucket_that_holds_them():
    params = SamplingParams(repetition_penalty=1.5)
    rows = [LogitRow(list(range(20)), [], params), LogitRow(list(range(30, 45)), [], params)]
    assert pack_logit_rows(rows, 2, (32, 64)).rows.shape == (64,)  # 35 entries
    assert pack_logit_rows(rows[:1], 2, (32, 64)).rows.shape == (32,)


def test_a_first_output_token_in_flight_is_the_only_entry():
    # no output token on the host yet, presence penalty only: the host sends no entry, the device makes one
    rows = [LogitRow([4, 5], [], SamplingParams(presence_penalty=1.5), in_flight_row=2)]
    packed = pack_logit_rows(rows, 1, (16,))
    assert (np.asarray(packed.rows) == 1).all()  # padding only
    logits = np.zeros((1, 10), np.float32)
    got = np.asarray(apply_logit_adjustments(jnp.asarray(logits), packed, jnp.asarray([0, 0, 8], jnp.int32)))
    want = logits.copy()
    want[0, 8] = -1.5
    np.testing.assert_array_equal(got, want)
