"""collect_prompt_logprobs (managers/prompt_logprobs.py): each prefill row's target is the next token of its
request, the prompt positions from logprob_start_len on are recorded once, and a preempted request recomputed
while its last token is in flight (the token is not on the host) gets no target for it. The runner is a stand-in
that returns the target as each row's logprob, so the test reads which targets it was given."""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.managers.in_flight import InFlightTokens
from sgl_jax_lora.managers.prompt_logprobs import collect_prompt_logprobs, top_list
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.sampling.sampling_params import SamplingParams


class EchoRunner:
    def __init__(self):
        self.targets = None

    def prompt_logprobs(self, hidden, targets: np.ndarray, num_top: int) -> dict:
        self.targets = targets.copy()
        rows = len(targets)
        return {
            "logprobs": -targets.astype(np.float32),
            "top_ids": np.tile(np.arange(4), (rows, 1)),
            "top_logprobs": np.zeros((rows, 4), np.float32),
        }


def test_targets_and_positions_skip_the_token_in_flight():
    asks = Req(rid="asks", input_ids=[10, 11, 12, 13, 14], sampling=SamplingParams(), seed=0, return_logprob=True)
    asks.logprob_start_len = 0
    recomputed = Req(rid="recomputed", input_ids=[20, 21, 22, 23], output_ids=[24], sampling=SamplingParams(), seed=0)
    InFlightTokens().add(recomputed, step=1, row=0)  # preempted while its second output token was in flight
    assert recomputed.remaining_prefill == 5  # prompt + the output on the host; the token in flight is fed next
    batch = ScheduleBatch(reqs=[asks, recomputed], num_new_tokens=[5, 5], token_slots=[0, 0])
    runner = EchoRunner()
    collect_prompt_logprobs(runner, batch, hidden=None, num_tokens=16)
    np.testing.assert_array_equal(runner.targets[:5], [11, 12, 13, 14, 0])  # the last row predicts an output
    np.testing.assert_array_equal(runner.targets[5:10], [21, 22, 23, 24, 0])  # no target for the token in flight
    assert asks.input_token_logprobs == [(None, 10, None)] + [(-float(t), t, None) for t in (11, 12, 13, 14)]
    assert recomputed.input_token_logprobs == []  # it did not ask


def test_top_list():
    assert top_list(np.array([5, 6, 7]), np.array([-0.5, -1.0, -2.0]), 2) == [(-0.5, 5), (-1.0, 6)]
    assert top_list(np.array([5]), np.array([-0.5]), 0) is None
