"""Host-side logit adjustments: penalties, logit_bias and min_new_tokens, for the rows that ask.

Flow: EngineCore builds a `LogitRow` per request of a step when some request in it adjusts its logits (most
batches never do), ModelRunner.launch_sample pulls the batch's logits to the host, `adjust_logits` applies these
rules, and the logits go back for `sampler.sample`. Order: repetition penalty (over prompt and output tokens, as in
HF), then frequency and presence penalties (over output tokens, as in OpenAI), then logit_bias (added to the logits
of its token ids), then the ban of stop and EOS tokens while a request is short of `min_new_tokens`. The returned
logprobs are those of the adjusted distribution.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sgl_jax_lora.sampling.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class LogitRow:
    """One request's part in a step's logit adjustments."""

    prompt_ids: list[int]
    output_ids: list[int]  # its tokens so far (penalties read them; they must have arrived)
    params: SamplingParams
    banned_ids: tuple[int, ...] = ()  # may not be sampled this step: stop and EOS ids before min_new_tokens

    @property
    def adjusts(self) -> bool:
        return self.params.adjusts_logits or bool(self.banned_ids)


def adjust_logits(logits: np.ndarray, rows: list[LogitRow | None]) -> np.ndarray:
    """logits [S, V] f32; rows[s] for logits row s, or None (padding) -> new logits."""
    logits = np.array(logits, dtype=np.float32, copy=True)
    vocab = logits.shape[1]
    for s, row in enumerate(rows):
        if row is None or not row.adjusts:
            continue
        params = row.params
        if params.repetition_penalty != 1:
            seen = np.unique(np.asarray(row.prompt_ids + row.output_ids, dtype=np.int64))
            values = logits[s, seen]
            penalty = params.repetition_penalty
            logits[s, seen] = np.where(values > 0, values / penalty, values * penalty)
        if row.output_ids and (params.frequency_penalty or params.presence_penalty):
            counts = np.bincount(np.asarray(row.output_ids, dtype=np.int64), minlength=vocab)[:vocab]
            logits[s] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if params.logit_bias:
            token_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            logits[s, token_ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
        if row.banned_ids:
            logits[s, [t for t in row.banned_ids if t < vocab]] = -np.inf
    return logits
