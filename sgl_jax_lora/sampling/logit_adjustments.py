"""Host-side logit adjustments: repetition / frequency / presence penalties and logit_bias, for the rows that ask.

Flow: ModelRunner.launch_sample pulls the batch's logits to the host only when some request in it adjusts its
logits (most batches never pay for this), applies these rules, and puts them back for `sampler.sample`.
Order: repetition penalty (over prompt and output tokens, as in HF), then frequency and presence penalties (over
output tokens, as in OpenAI), then logit_bias (added to the logits of its token ids). The returned logprobs are
those of the adjusted distribution.
"""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.sampling.sampling_params import SamplingParams


def adjust_logits(
    logits: np.ndarray, rows: list[tuple[list[int], list[int], SamplingParams] | None]
) -> np.ndarray:
    """logits [S, V] f32; rows[s] = (prompt ids, output ids, params) or None (padding) -> new logits."""
    logits = np.array(logits, dtype=np.float32, copy=True)
    vocab = logits.shape[1]
    for s, row in enumerate(rows):
        if row is None or not row[2].adjusts_logits:
            continue
        prompt_ids, output_ids, params = row
        if params.repetition_penalty != 1:
            seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
            values = logits[s, seen]
            penalty = params.repetition_penalty
            logits[s, seen] = np.where(values > 0, values / penalty, values * penalty)
        if output_ids and (params.frequency_penalty or params.presence_penalty):
            counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab]
            logits[s] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if params.logit_bias:
            token_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            logits[s, token_ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    return logits
