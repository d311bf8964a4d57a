"""Prompt logprobs: the logprob of each prompt token (and the top alternatives) for requests that ask for them.

`top_list` and `finite_logprob` give the logprobs as Python values (None where not finite), here and for sampled tokens.

Flow: EngineCore._launch runs the forward of a step with prefill chunks -> `collect_prompt_logprobs` gives the
runner each row's next prompt token as target and waits for their logprobs (the one device wait of a launch, for
the rare requests that ask) -> each request's `input_token_logprobs` grows by the positions of its chunk, from
logprob_start_len on; positions collected before a preemption are not collected again.
"""

from __future__ import annotations

import math

import numpy as np

from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS


def collect_prompt_logprobs(runner, batch: ScheduleBatch, hidden, num_tokens: int) -> None:
    """Record the prompt logprobs of the step's prefill chunks whose requests asked for them (runner: ModelRunner,
    hidden: the forward's hidden states, num_tokens: the padded T)."""
    wanted = [(i, r) for i, r in enumerate(batch.reqs) if r.return_logprob and r.num_computed < len(r.input_ids)]
    if not wanted:
        return
    targets = np.zeros(num_tokens, np.int32)
    starts = np.cumsum([0] + batch.num_new_tokens)
    for i, req in enumerate(batch.reqs):
        all_ids = req.all_ids
        for j in range(batch.num_new_tokens[i]):
            nxt = req.num_computed + j + 1
            if nxt < len(all_ids):  # not the token in flight after a preempted request's recompute (unused)
                targets[starts[i] + j] = all_ids[nxt]
    num_top = max(r.top_logprobs_num for _, r in wanted)
    result = runner.prompt_logprobs(hidden, targets, MAX_TOP_LOGPROBS if num_top else 0)
    for i, req in wanted:
        if req.next_prompt_logprob_pos < 0:  # first chunk: start at logprob_start_len
            req.next_prompt_logprob_pos = req.prompt_logprob_start
            if req.next_prompt_logprob_pos == 0:
                req.input_token_logprobs.append((None, req.input_ids[0], None))
                req.next_prompt_logprob_pos = 1
        for j in range(batch.num_new_tokens[i]):
            position = req.num_computed + j + 1  # the prompt token this row predicts
            if position != req.next_prompt_logprob_pos or position >= len(req.input_ids):
                continue  # before logprob_start_len, or already collected before a preemption
            row = starts[i] + j
            top = top_list(result["top_ids"][row], result["top_logprobs"][row], req.top_logprobs_num)
            req.input_token_logprobs.append((finite_logprob(result["logprobs"][row]), req.input_ids[position], top))
            req.next_prompt_logprob_pos += 1


def top_list(ids: np.ndarray, logprobs: np.ndarray, num: int) -> list | None:
    """The first `num` (logprob, token id) pairs of a row's top logprobs; None when none were asked for."""
    if num <= 0:
        return None
    return [(finite_logprob(lp), int(t)) for lp, t in zip(logprobs[:num], ids[:num])]


def finite_logprob(value) -> float | None:
    """A logprob as a Python float, or None where the logits were not finite (weights or an adapter whose values
    overflow the model's activations): JSON has no NaN or infinity, and a response must stay valid JSON."""
    value = float(value)
    return value if math.isfinite(value) else None
