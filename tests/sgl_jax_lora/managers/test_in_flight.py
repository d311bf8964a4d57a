"""InFlightTokens (managers/in_flight.py): the engine's record of tokens sampled by a launched step whose ids have
not reached the host. Requests never hold placeholder ids: their counts that include the token in flight
(seq_len, num_output_tokens) come from the count the record keeps, and the next step reads the token on the device
from its row (ScheduleBatch.to_forward_batch)."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.managers.in_flight import InFlightToken, InFlightTokens
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.sampling.sampling_params import SamplingParams


def req(rid: str, length: int = 5, outputs: tuple[int, ...] = (), max_new_tokens: int = 4) -> Req:
    return Req(
        rid=rid,
        input_ids=list(range(2, 2 + length)),
        output_ids=list(outputs),
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        seed=0,
    )


def test_a_token_in_flight_counts_until_it_lands():
    tokens = InFlightTokens()
    r = req("r", length=5, outputs=(9,), max_new_tokens=2)
    assert (r.seq_len, r.num_output_tokens, r.out_of_new_tokens) == (6, 1, False)
    tokens.add(r, step=3, row=1)
    assert r in tokens and len(tokens) == 1 and list(tokens) == [r]
    assert tokens.get(r) == InFlightToken(step=3, row=1) and tokens.row(r) == 1
    assert r.output_ids == [9] and r.all_ids == [2, 3, 4, 5, 6, 9]  # no placeholder in the request's data
    assert (r.seq_len, r.num_output_tokens, r.out_of_new_tokens) == (7, 2, True)  # as if it had landed
    assert tokens.pop(r) == InFlightToken(step=3, row=1)
    assert r not in tokens and tokens.row(r) == -1 and tokens.pop(r) is None
    assert r.num_in_flight == 0 and r.seq_len == 6  # the engine appends the real id when the token lands


def test_one_token_in_flight_per_request():
    tokens = InFlightTokens()
    r = req("r")
    tokens.add(r, step=1, row=0)
    with pytest.raises(AssertionError, match="already has a token in flight"):
        tokens.add(r, step=2, row=0)
    assert r.num_in_flight == 1


def test_clear_drops_every_token_in_flight():
    tokens = InFlightTokens()
    a, b = req("a"), req("b", outputs=(4,))
    tokens.add(a, step=1, row=0)
    tokens.add(b, step=1, row=1)
    tokens.clear()
    assert len(tokens) == 0 and a.num_in_flight == b.num_in_flight == 0
    assert a.seq_len == 5 and b.seq_len == 6


def test_a_decode_row_reads_its_token_in_flight_from_its_row():
    # "landed" feeds its last output token from the host; "flying" feeds the token the step in flight samples at
    # row 2 of that step's ids; both at the position after their last token
    buckets = Buckets.build(8, 32, 256, 4)
    landed, flying = req("landed", outputs=(11, 12)), req("flying", outputs=(13,))
    tokens = InFlightTokens()
    tokens.add(flying, step=5, row=2)
    for r in (landed, flying):
        r.num_computed = r.seq_len - 1
        r.pages = [1 + 4 * (r is flying), 2 + 4 * (r is flying)]
    batch = ScheduleBatch(reqs=[landed, flying], num_new_tokens=[1, 1], token_slots=[0, 0], num_decode_rows=2)
    fb = batch.to_forward_batch(buckets, 4, lambda slots: None, tokens)
    np.testing.assert_array_equal(fb.input_ids[:2], [12, 0])
    np.testing.assert_array_equal(fb.input_from_prev[:2], [-1, 2])
    assert (fb.input_from_prev[2:] == -1).all()
    np.testing.assert_array_equal(fb.positions[:2], [6, 6])  # 5 prompt tokens + 2 outputs, the last being fed
    np.testing.assert_array_equal(fb.seq_lens[:2], [7, 7])
    with pytest.raises(ValueError, match="no InFlightTokens records"):
        batch.to_forward_batch(buckets, 4, lambda slots: None)
    sampling = batch.to_sampling_batch(fb.num_seqs)
    np.testing.assert_array_equal(sampling.steps[:2], [2, 2])  # the token in flight counts, as without overlap
