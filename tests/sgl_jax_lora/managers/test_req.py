"""sgl_jax_lora/managers/req.py: Req's token bookkeeping through a request's life (prefill in chunks, decode, a token
in flight, preemption and re-prefill), its length limit, finish state, prompt-logprob start and identity equality."""

from __future__ import annotations

from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.sampling.sampling_params import SamplingParams


def make_req(prompt_len: int = 5, max_new_tokens: int = 3, **kwargs) -> Req:
    return Req(
        rid="r",
        input_ids=list(range(100, 100 + prompt_len)),
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        seed=0,
        **kwargs,
    )


def test_a_new_request_prefills_its_whole_prompt_in_chunks():
    req = make_req(prompt_len=5)
    assert (req.seq_len, req.num_output_tokens, req.remaining_prefill) == (5, 0, 5)
    assert req.is_prefilling and not req.finished
    req.num_computed = 3  # a first chunk of 3 tokens
    assert req.remaining_prefill == 2 and req.is_prefilling
    req.num_computed = 5
    assert req.remaining_prefill == 0 and not req.is_prefilling


def test_decoding_keeps_the_last_token_to_feed_next():
    req = make_req(prompt_len=5)
    req.num_computed = 5
    req.output_ids.append(7)  # the prefill sampled the first output token
    assert req.all_ids == [100, 101, 102, 103, 104, 7]
    assert (req.seq_len, req.num_output_tokens) == (6, 1)
    assert req.remaining_prefill == 0 and not req.is_prefilling  # computed == len(all_ids) - 1: it decodes
    req.num_computed = 6
    req.output_ids.append(8)
    assert req.remaining_prefill == 0 and req.seq_len == 7


def test_a_token_in_flight_counts_in_lengths_but_not_in_all_ids():
    req = make_req(prompt_len=4, max_new_tokens=2)
    req.output_ids.append(9)
    req.num_computed = 5  # a launched decode step fed token 9 ...
    req.num_in_flight = 1  # ... and sampled the second output token, not on the host yet
    assert req.all_ids == [100, 101, 102, 103, 9]
    assert (req.num_output_tokens, req.seq_len) == (2, 6)
    assert req.out_of_new_tokens
    assert req.remaining_prefill == 0 and not req.is_prefilling
    req.num_computed = 0  # preempted while the token is in flight: all 5 tokens on the host are prefilled again
    assert req.remaining_prefill == 5


def test_a_preempted_request_prefills_everything_but_its_last_token():
    req = make_req(prompt_len=5, max_new_tokens=10)
    req.output_ids.extend([7, 8, 9])
    req.num_computed = 0  # preempted: pages dropped
    assert req.seq_len == 8
    assert req.remaining_prefill == 7 and req.is_prefilling
    req.num_computed = 7
    assert not req.is_prefilling


def test_length_limit_and_finish():
    req = make_req(prompt_len=5, max_new_tokens=3)
    assert req.max_seq_len == 8
    req.output_ids.extend([1, 2])
    assert not req.out_of_new_tokens
    req.output_ids.append(3)
    assert req.out_of_new_tokens
    req.finish_reason = {"type": "length", "length": 3}
    assert req.finished


def test_prompt_logprob_start():
    assert make_req(prompt_len=5).prompt_logprob_start == 5  # no logprobs asked: none of the prompt
    assert make_req(prompt_len=5, logprob_start_len=2).prompt_logprob_start == 5
    assert make_req(prompt_len=5, return_logprob=True).prompt_logprob_start == 5  # -1: none of the prompt
    assert make_req(prompt_len=5, return_logprob=True, logprob_start_len=0).prompt_logprob_start == 0
    assert make_req(prompt_len=5, return_logprob=True, logprob_start_len=3).prompt_logprob_start == 3
    assert make_req(prompt_len=5, return_logprob=True, logprob_start_len=9).prompt_logprob_start == 5


def test_requests_compare_by_identity_and_own_their_lists():
    first, second = make_req(), make_req()
    assert first != second and first == first
    assert first in [first] and second not in [first]
    first.output_ids.append(1)
    first.pages.append(3)
    assert second.output_ids == [] and second.pages == []
    assert len({first, second}) == 2  # hashable, by identity
