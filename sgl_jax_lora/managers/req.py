"""Req: one request's state inside the engine process, from admission to finish.

Flow: engine loop receives a tokenized request -> Req -> Scheduler queues (waiting -> running) ->
ScheduleBatch reads/advances it -> finished Reqs free their pages and send their last output.

Token bookkeeping: `all_ids` = prompt + outputs; `num_computed` tokens of all_ids have K/V in the cache.
A running (decoding) Req always has num_computed == len(all_ids) - 1: its last sampled token is fed next.
A preempted Req drops its pages, resets num_computed to 0 and is prefilled again over all_ids but the
last token, which the next decode step feeds as usual.

Overlap schedule (engine_core.py): a launched step advances its requests at once, before its tokens reach
the host; each sampled token is then `PENDING_TOKEN` at the end of output_ids, and `pending_row` is its row in
that step's sampled ids, from which the next step reads it on the device. It is always the last entry of
all_ids, which prefill never feeds, and finishing the step (EngineCore._finish) overwrites it with the real id.
"""

from __future__ import annotations

import dataclasses
import time

from sgl_jax_lora.sampling.sampling_params import SamplingParams

PENDING_TOKEN = -1  # an output token sampled by a step whose results have not reached the host yet


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
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    # progress
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pending_row: int = -1  # row of the PENDING_TOKEN at the end of output_ids in its step's sampled ids
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
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to prefill: the prompt, or after a preemption all_ids but the token fed next."""
        target = self.seq_len - 1 if self.output_ids else self.seq_len
        return max(0, target - self.num_computed)

    @property
    def is_prefilling(self) -> bool:
        return self.remaining_prefill > 0

    @property
    def out_of_new_tokens(self) -> bool:
        """Its last allowed token is sampled (maybe still in flight): it finishes by length, no step feeds it."""
        return len(self.output_ids) >= self.sampling.max_new_tokens

    @property
    def has_pending_token(self) -> bool:
        """Its last output token was sampled by a step whose results have not reached the host yet."""
        return bool(self.output_ids) and self.output_ids[-1] == PENDING_TOKEN

    @property
    def resolved_output_ids(self) -> list[int]:
        """output_ids without a PENDING_TOKEN at the end."""
        return self.output_ids[:-1] if self.has_pending_token else self.output_ids

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
