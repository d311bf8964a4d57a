"""Req: one request's state inside the engine process, from admission to finish.

Flow: engine loop receives a tokenized request -> Req -> Scheduler queues (waiting -> running) ->
ScheduleBatch reads/advances it -> finished Reqs free their pages and send their last output.

Token bookkeeping: `all_ids` = prompt + outputs; `num_computed` tokens of all_ids have K/V in the cache.
A running (decoding) Req always has num_computed == len(all_ids) - 1: its last sampled token is fed next.
A preempted Req drops its pages, resets num_computed to 0 and is prefilled again over all_ids but the
last token, which the next decode step feeds as usual.

Overlap schedule (engine_core.py): a launched step advances its requests at once, before its tokens reach
the host. `output_ids` holds only the tokens that reached the host; a token still in flight is recorded by the
engine (managers/in_flight.py: its step and row, from which the next step reads it on the device), and
`num_in_flight` counts it here, so that `seq_len` and `num_output_tokens` count it as if it had landed. It is
always the token after all_ids, which prefill never feeds; finishing the step (EngineCore._finish) appends it.
"""

from __future__ import annotations

import dataclasses
import time

from sgl_jax_lora.sampling.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)  # identity: queues compare requests by object, never field by field
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora_slot_key: str | None = None  # adapter id (LoRARef.lora_id) or None for base
    priority: int = 0  # the scheduler admits lower values first (--scheduling-policy priority); 0 under fcfs
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    arrival_seq: int = 0  # the scheduler's order of receipt: a call's prompts and samples share an arrival_time
    # progress
    output_ids: list[int] = dataclasses.field(default_factory=list)  # tokens that reached the host
    num_in_flight: int = 0  # output tokens sampled but not on the host yet (0 or 1; written by InFlightTokens)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: dict | None = None
    times_overtaken: int = 0  # requests that arrived after it and were admitted first (bounded; see scheduler)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at admission
    # logprobs gathered so far, sent incrementally
    input_token_logprobs: list = dataclasses.field(default_factory=list)
    output_token_logprobs: list = dataclasses.field(default_factory=list)
    num_sent_outputs: int = 0
    num_sent_input_logprobs: int = 0
    next_prompt_logprob_pos: int = -1  # next prompt position whose logprob is recorded; -1 = not started

    @property
    def all_ids(self) -> list[int]:
        """Prompt + the output tokens on the host (a token in flight is not among them)."""
        return self.input_ids + self.output_ids

    # The counts below are read for every running request in every step (scheduler, batch, stop checks): each
    # computes from the lists directly rather than through the others.
    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the one in flight included."""
        return len(self.output_ids) + self.num_in_flight

    @property
    def seq_len(self) -> int:
        """Prompt + output tokens, the one in flight included."""
        return len(self.input_ids) + len(self.output_ids) + self.num_in_flight

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to prefill: the prompt, or after a preemption all tokens but the one fed next."""
        num_output = len(self.output_ids) + self.num_in_flight
        target = len(self.input_ids) + num_output - (1 if num_output else 0)
        return max(0, target - self.num_computed)

    @property
    def is_prefilling(self) -> bool:
        num_output = len(self.output_ids) + self.num_in_flight
        return len(self.input_ids) + num_output - (1 if num_output else 0) > self.num_computed

    @property
    def out_of_new_tokens(self) -> bool:
        """Its last allowed token is sampled (maybe still in flight): it finishes by length, no step feeds it."""
        return len(self.output_ids) + self.num_in_flight >= self.sampling.max_new_tokens

    @property
    def max_seq_len(self) -> int:
        return len(self.input_ids) + self.sampling.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_logprob_start(self) -> int:
        """First prompt position whose logprob is returned (-1 in the API means: none of the prompt)."""
        if not self.return_logprob or self.logprob_start_len < 0:
            return len(self.input_ids)
        return min(self.logprob_start_len, len(self.input_ids))
