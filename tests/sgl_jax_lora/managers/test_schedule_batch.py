"""sgl_jax_lora/managers/schedule_batch.py: a ScheduleBatch's counts and kind, its bucket, and its padding into a
ForwardBatch (ragged layout, token ids of decode rows, prefill chunks and re-prefilled requests, positions, KV-cache
slots from the page tables, per-token LoRA slots, last-token rows, tokens in flight) and into a SamplingBatch
(per-row parameters, greedy rows, seeds, steps, top-logprob width); expectations worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.lora.adapter_plan import AdapterPlan, SlotWrite
from sgl_jax_lora.managers.in_flight import InFlightTokens
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

BUCKETS = Buckets(tokens=(8, 16, 32), max_seqs=4, max_pages_per_seq=4)
PAGE = 4


def req(rid, prompt, outputs=(), computed=0, pages=(), **sampling) -> Req:
    r = Req(rid=rid, input_ids=list(prompt), sampling=SamplingParams(**sampling), seed=0, output_ids=list(outputs))
    r.num_computed, r.pages = computed, list(pages)
    return r


def mixed_batch() -> ScheduleBatch:
    """A decode row (7 tokens, feeds its last output at position 6), the middle chunk of a 10-token prompt
    (positions 4..6) and a whole 2-token prompt."""
    decode = req("d", range(10, 15), outputs=(20, 21), computed=6, pages=(3, 5))
    middle = req("m", range(30, 40), computed=4, pages=(7, 8))
    whole = req("w", (50, 51), pages=(9,))
    return ScheduleBatch(
        reqs=[decode, middle, whole], num_new_tokens=[1, 3, 2], token_slots=[2, 0, 1], num_decode_rows=1
    )


def test_counts_kind_and_bucket():
    batch = mixed_batch()
    assert batch.num_tokens == 6 and batch.kind == "mixed"
    assert batch.padded_sizes(BUCKETS) == (4, 8)  # 6 tokens -> T = 8; S = min(T, max_seqs)
    decode_only = ScheduleBatch(reqs=batch.reqs[:1], num_new_tokens=[1], token_slots=[0], num_decode_rows=1)
    assert decode_only.kind == "decode" and decode_only.padded_sizes(BUCKETS) == (4, 8)
    extend = ScheduleBatch(reqs=batch.reqs[1:], num_new_tokens=[9, 2], token_slots=[0, 0])
    assert extend.kind == "extend" and extend.padded_sizes(BUCKETS) == (4, 16)
    tiny = Buckets(tokens=(2, 8), max_seqs=4, max_pages_per_seq=4)
    assert decode_only.padded_sizes(tiny) == (2, 2)  # S never exceeds T
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        ScheduleBatch(reqs=batch.reqs[1:], num_new_tokens=[30, 3], token_slots=[0, 0]).padded_sizes(BUCKETS)


def test_slot_writes_come_from_the_batchs_own_adapter_plan():
    write = SlotWrite(slot=1, lora_id="a", values=[np.zeros(2)])
    batch = ScheduleBatch(reqs=[], num_new_tokens=[], token_slots=[], adapters=AdapterPlan(slot_writes=[write]))
    assert batch.slot_writes == [write]
    first, second = ScheduleBatch([], [], []), ScheduleBatch([], [], [])
    first.adapters.slot_writes.append(write)
    assert second.slot_writes == [] and first.slot_writes == [write]


def test_forward_batch_of_a_mixed_step():
    seen = {}

    def builder(token_slot):
        seen["token_slot"] = token_slot.copy()
        return "lora"

    fb = mixed_batch().to_forward_batch(BUCKETS, PAGE, builder)
    np.testing.assert_array_equal(fb.cu_q_lens, [0, 1, 4, 6, 6])
    np.testing.assert_array_equal(fb.seq_lens, [7, 7, 2, 0])
    np.testing.assert_array_equal(fb.page_table, [[3, 5, 0, 0], [7, 8, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(fb.input_ids, [21, 34, 35, 36, 50, 51, 0, 0])
    np.testing.assert_array_equal(fb.positions, [6, 4, 5, 6, 0, 1, 0, 0])
    # page * 4 + offset: position 6 -> page 5 offset 2; 4..6 -> page 8 offsets 0..2; 0, 1 -> page 9; padding -> 0
    np.testing.assert_array_equal(fb.cache_loc, [22, 32, 33, 34, 36, 37, 0, 0])
    np.testing.assert_array_equal(fb.last_token_index, [0, 3, 5, 0])
    np.testing.assert_array_equal(fb.input_from_prev, [-1] * 8)
    np.testing.assert_array_equal(seen["token_slot"], [2, 0, 0, 0, 1, 1, 0, 0])
    assert fb.lora == "lora" and (fb.num_tokens, fb.num_seqs) == (8, 4)
    for array in (fb.input_ids, fb.positions, fb.cache_loc, fb.seq_lens, fb.cu_q_lens, fb.page_table):
        assert array.dtype == np.int32


def test_a_preempted_request_is_prefilled_again_from_its_prompt_and_outputs():
    # prompt 1, 2, 3 and outputs 4, 5: prefilled again over all tokens but the last, which its decode row feeds next
    again = req("again", (1, 2, 3), outputs=(4, 5), pages=(6, 2))
    batch = ScheduleBatch(reqs=[again], num_new_tokens=[again.remaining_prefill], token_slots=[3])
    assert batch.num_tokens == 4 and batch.kind == "extend"
    fb = batch.to_forward_batch(BUCKETS, PAGE, lambda slots: None)
    np.testing.assert_array_equal(fb.input_ids[:4], [1, 2, 3, 4])
    np.testing.assert_array_equal(fb.positions[:4], [0, 1, 2, 3])
    np.testing.assert_array_equal(fb.cache_loc[:4], [24, 25, 26, 27])
    assert fb.lora is None and batch.sampling_reqs() == []  # it samples nothing until its decode row


def test_a_decode_row_whose_token_is_in_flight():
    flying = req("f", (7, 8), outputs=(9,), computed=3, pages=(1,))  # 7, 8, 9 cached; the 4th flies
    tokens = InFlightTokens()
    tokens.add(flying, step=4, row=3)
    batch = ScheduleBatch(reqs=[flying], num_new_tokens=[1], token_slots=[0], num_decode_rows=1)
    fb = batch.to_forward_batch(BUCKETS, PAGE, lambda slots: None, tokens)
    np.testing.assert_array_equal(fb.input_from_prev, [3] + [-1] * 7)  # read on the device from row 3
    assert fb.input_ids[0] == 0 and fb.positions[0] == 3 and fb.seq_lens[0] == 4 and fb.cache_loc[0] == 7
    with pytest.raises(ValueError, match="request f has a token in flight"):
        batch.to_forward_batch(BUCKETS, PAGE, lambda slots: None, InFlightTokens())


def test_sampling_reqs_are_decode_rows_and_finishing_chunks():
    batch = mixed_batch()
    assert [r.rid for r in batch.sampling_reqs()] == ["d", "w"]  # the middle chunk ends at 7 of 10 tokens


def test_sampling_batch_rows_follow_the_requests_and_padding_is_greedy():
    batch = mixed_batch()
    decode, middle, whole = batch.reqs
    decode.sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1)
    decode.seed = 2**32 + 7
    middle.sampling = SamplingParams(temperature=0.8, top_k=1)  # top_k 1: greedy whatever the temperature
    middle.seed = 11
    whole.return_logprob, whole.top_logprobs_num = True, 3
    sampling = batch.to_sampling_batch(6)
    np.testing.assert_allclose(sampling.temperature, [0.7, 0.0, 1.0, 0, 0, 0])
    np.testing.assert_allclose(sampling.top_p, [0.9, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(sampling.top_k, [5, 1, 0, 0, 0, 0])  # -1 (off) becomes 0
    np.testing.assert_allclose(sampling.min_p, [0.1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(sampling.seeds, [7, 11, 0, 0, 0, 0])
    np.testing.assert_array_equal(sampling.steps, [2, 0, 0, 0, 0, 0])
    assert sampling.seeds.dtype == np.uint32 and sampling.temperature.dtype == np.float32
    assert not sampling.is_greedy and sampling.num_top_logprobs == MAX_TOP_LOGPROBS
    assert sampling.filters  # the decode row's top_p, top_k and min_p: the program with the threshold search


def test_a_sampled_batch_filters_only_where_a_sampled_row_asks():
    batch = mixed_batch()
    decode, middle, whole = batch.reqs
    decode.sampling = SamplingParams(temperature=0.7)  # sampled, no filter
    middle.sampling = SamplingParams(temperature=0.0, top_p=0.5)  # greedy: its top_p is never applied
    whole.sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
    sampling = batch.to_sampling_batch(4)
    assert not sampling.is_greedy and not sampling.filters  # sampled without the search
    whole.sampling = SamplingParams(temperature=1.0, min_p=0.05)
    assert batch.to_sampling_batch(4).filters


def test_an_all_greedy_batch_without_top_logprobs():
    batch = mixed_batch()
    for r in batch.reqs:
        r.sampling = SamplingParams(temperature=0.0)
    batch.reqs[0].return_logprob = True  # logprobs, but no alternatives
    sampling = batch.to_sampling_batch(4)
    assert sampling.is_greedy and sampling.num_top_logprobs == 0
    np.testing.assert_array_equal(sampling.temperature, np.zeros(4))
